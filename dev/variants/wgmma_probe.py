"""
Runs dev/variants/wgmma_probe.cu on an H100 or H200 (sm_90a): each variant's c (64, N) = a @ b,
one warpgroup of wgmma.mma_async reading bf16 a and b from shared memory through matrix
descriptors, against numpy in float64. Not part of NanoEuler.

    python dev/variants/wgmma_probe.py

One line a variant: the largest error, that error over the bound of summing the K products in fp32
(K 2^-24 |a| @ |b|), OK or NOT OK. Then the probe's products of many tiles, c (M, N) bf16 = a @ b.T
(wgmma_gemm_bn128, _bn256 fed by cp.async; the TMA_GEMMS below fed by TMA through mbarriers, a producer
warpgroup and two consumers: a block a tile with 4 or 6 stages, or persistent, c stored from registers or
through shared memory and TMA), are checked the same way (with room for c's rounding to bf16) and
timed against cuBLAS (cublasGemmEx, as Cublas.gemm calls it) on the big model's forward products at
batch 64 x 512, in one run: a row a kernel, median us of 20, TFLOP/s and cuBLAS's time over its own.
Then the backward's two other layouts, checked the same way and timed beside cuBLAS called as the backward calls
it: the data gradients c (M, N) bf16 = a (M, K) @ b (K, N) (NN_GEMMS: b read along its rows, wgmma's transposed
b) and the weight gradients c (M, N) fp32 += a.T @ b, a (K, M) and b (K, N), K the batch's tokens (split over
blocks, the partials summed in a fixed order by a second pass).
Last, "all OK" or how many were not (exit code 1). test_wgmma.py runs the same variants on the CPU
emulator (tools/emulate_cuda.py) with the same operands: both OK means the emulator lays out wgmma's
accumulators and reads its descriptors and swizzles as this GPU does.
A wrong layout is off by about the size of the products (a ratio of 10^5 or more), so OK allows the
tensor core some room over the sequential fp32 sum's bound (16 x): its order and rounding are its own.
"""

import ctypes
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
import nanoeuler_cuda as nc                                    # noqa: E402

ROOM = 16          # OK: every element within 16 times the fp32 bound


def bf16_bits(x):
    """float32 -> bf16 bits, rounded to nearest even (x has no NaN)"""
    u = np.asarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + (u >> 16 & 1)) >> 16).astype(np.uint16)


def from_bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


# name: (N, K, a M-major, b N-major); as the probe's entry points are named (ar: a K-major, into registers)
VARIANTS = {"wgmma_n64_interleave_ak_bk": (64, 64, False, False),
            "wgmma_n64_interleave_ak_bn": (64, 64, False, True),
            "wgmma_n128_interleave_am_bn": (128, 48, True, True),
            "wgmma_n128_sw128_ak_bk": (128, 128, False, False),
            "wgmma_n128_sw128_ak_bn": (128, 64, False, True),
            "wgmma_n64_sw64_am_bk": (64, 64, True, False),
            "wgmma_n128_sw32_am_bn": (128, 32, True, True),
            "wgmma_n64_interleave_ak_bk_two_groups": (64, 64, False, False),
            "wgmma_n64_sw128_ar_bn": (64, 64, False, True),
            "wgmma_n64_sw128_ar_bn_two_groups": (64, 64, False, True),
            "wgmma_n128_interleave_ar_bk": (128, 48, False, False)}


def operands(N, K, a_mn, b_mn, seed):
    """random bf16 a and b as the probe reads them (row-major; a (K, 64) when a_mn, b (K, N) when b_mn),
    and a (64, K), b (K, N) as float64 for numpy"""
    rng = np.random.default_rng(seed)
    a = bf16_bits(rng.normal(size=(K, 64) if a_mn else (64, K)))
    b = bf16_bits(rng.normal(size=(K, N) if b_mn else (N, K)))
    A, B = from_bf16(a).astype(np.float64), from_bf16(b).astype(np.float64)
    return a, b, A.T if a_mn else A, B if b_mn else B.T


def fp32_bound(A, B):
    """what summing the K exact products in fp32 may be off by, elementwise: K 2^-24 (|A| @ |B|)"""
    return A.shape[1] * 2.0 ** -24 * (np.abs(A) @ np.abs(B))


def launch(module, name, grid, block, shared, *args):
    cu, check = nc.cu, nc.check
    f = check(cu.cuModuleGetFunction(module, name.encode()), name)
    check(cu.cuFuncSetAttribute(f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
          "cuFuncSetAttribute")
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])
    nc.gpu.last_kernel = name
    check(cu.cuLaunchKernel(f, *grid, block, 1, 1, shared, nc.gpu.stream, ctypes.addressof(params), 0), name)


def gemm(module, BN, c, a, b, M, N, K):
    """the probe's product c (M, N) = a @ b.T, 128 x BN tiles"""
    launch(module, f"wgmma_gemm_bn{BN}", (N // BN, M // 128, 1), 256, 4 * (128 + BN) * 128 + 1024, nc.ptr_arg(c),
           nc.ptr_arg(a), nc.ptr_arg(b), nc.int_arg(N), nc.int_arg(K))


def tensor_map(x, rows, cols, box_rows):
    """a CUtensorMap of the bf16 matrix x (rows, cols) row-major, boxes of 64 columns (128 bytes) x box_rows
    with the 128-byte swizzle, as 128 bytes to pass by value"""
    cu, check = nc.cu, nc.check
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t                    # (cuda-python takes no plain ints for these)
    m = check(cu.cuTensorMapEncodeTiled(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, x.ptr,
                                        [u64(cols), u64(rows)], [u64(cols * 2)], [u32(64), u32(box_rows)],
                                        [u32(1), u32(1)],
                                        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                                        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                                        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
              "cuTensorMapEncodeTiled")
    return (ctypes.c_uint64 * 16)(*[int(w) for w in m.opaque])


# the products fed by TMA, by entry point: BN, stages, persistent (grid = the SMs), c stored through shared memory
# and TMA (a third tensor map, 32 KB more shared memory)
TMA_GEMMS = {"wgmma_tma_gemm_bn128": (128, 4, False, False), "wgmma_tma_gemm_bn256": (256, 4, False, False),
             "wgmma_tma_gemm_bn128_s6": (128, 6, False, False),
             "wgmma_tma_persistent_bn256": (256, 4, True, False),
             "wgmma_tma_persistent_bn128_s6": (128, 6, True, False),
             "wgmma_tma_persistent_store_bn256": (256, 4, True, True),
             "wgmma_tma_persistent_store_bn128_s6": (128, 6, True, True),
             "wgmma_tma_persistent_store_bn256_split": (256, 4, True, True),
             "wgmma_tma_pingpong_bn128_s6": (128, 6, True, True),
             "wgmma_tma_persistent_bn256_no_store": (256, 4, True, False),
             "wgmma_tma_persistent_bn256_copies_only": (256, 4, True, False)}
# the backward's data gradient, c (M, N) = a (M, K) @ b (K, N), b row-major: the same fields as TMA_GEMMS
NN_GEMMS = {"wgmma_tma_persistent_store_nn_bn256": (256, 4, True, True)}
# timed, not checked (they do not write c): where the time goes, the main loop without the epilogue and the copies
# without the main loop
TIMING_ONLY = ("wgmma_tma_persistent_bn256_no_store", "wgmma_tma_persistent_bn256_copies_only")


def tma_maps(name, c, a, b, M, N, K):
    """the tensor maps of a TMA-fed product: a's (boxes 64 x 128), b's (64 x BN; NN_GEMMS: b (K, N), 64 x 64), c's
    (64 x 64)"""
    if name in NN_GEMMS:
        return tensor_map(a, M, K, 128), tensor_map(b, K, N, 64), tensor_map(c, M, N, 64)
    BN = TMA_GEMMS[name][0]
    return tensor_map(a, M, K, 128), tensor_map(b, N, K, BN), tensor_map(c, M, N, 64)


def tma_gemm(module, name, c, a, b, M, N, K, maps=None, blocks=None):
    """the probe's product fed by TMA (the entry point name of TMA_GEMMS or NN_GEMMS): c (M, N) = a @ b.T (NN_GEMMS:
    a @ b), 128 x BN tiles; maps: tma_maps, made once for a timing; a persistent one on `blocks` blocks (or one an
    SM), at most one a tile"""
    BN, stages, persistent, boxes = {**TMA_GEMMS, **NN_GEMMS}[name]
    map_a, map_b, map_c = maps or tma_maps(name, c, a, b, M, N, K)
    shared = stages * (128 + BN) * 128 + 1024 + 16 * stages + (32768 if boxes else 0)
    if persistent:
        launch(module, name, (min(blocks or nc.gpu.sms, M // 128 * (N // BN)), 1, 1), 384, shared, nc.ptr_arg(c), map_a,
               map_b, map_c, nc.int_arg(M), nc.int_arg(N), nc.int_arg(K))
    else:
        launch(module, name, (N // BN, M // 128, 1), 384, shared, nc.ptr_arg(c), map_a, map_b, nc.int_arg(N),
               nc.int_arg(K))


# the products checked and timed: (name, how it is launched, its row in the table); checked with a persistent one's
# blocks walking several tiles each (5 blocks)
GEMMS = [("wgmma_gemm_bn128", lambda module, *args, **_: gemm(module, 128, *args), "cp.async 128x128"),
         ("wgmma_gemm_bn256", lambda module, *args, **_: gemm(module, 256, *args), "cp.async 128x256"),
         *((name, lambda module, *args, name=name, **options: tma_gemm(module, name, *args, **options),
            name.replace("wgmma_", "")) for name in TMA_GEMMS)]


# the weight gradient, split over K (wgmma_tma_splitk_tn_bn256, then splitk_reduce_add): c (M, N) fp32 += a.T @ b
SPLITK = "wgmma_tma_splitk_tn_bn256"
SPLITK_BN, SPLITK_STAGES = 256, 4
SPLIT_SWEEP = (1, 2, 4, 8)    # timed beside splits_for's choice


def splits_for(M, N, K, sms):
    """the smallest number of splits of K whose units (tiles x splits) fill 90% of the SMs' waves (at most 16, at
    most K / 64): fewer splits, fewer partials to write and sum"""
    tiles = M // 128 * (N // SPLITK_BN)
    for splits in range(1, min(16, K // 64) + 1):
        units = tiles * splits
        if units / (-(-units // sms) * sms) >= 0.9:
            return splits
    return min(16, K // 64)


def splitk_maps(a, b, M, N, K):
    """the split product's tensor maps: a's (K, M) and b's (K, N), boxes of 64 columns x 64 rows"""
    return tensor_map(a, K, M, 64), tensor_map(b, K, N, 64)


def splitk_tn(module, c, a, b, M, N, K, partials, splits, maps=None, blocks=None, reduce=True):
    """c (M, N) fp32 += a.T @ b, a (K, M) and b (K, N) bf16: the split product into partials (splits x M x N fp32),
    persistent on `blocks` blocks (or one an SM), then their sum added into c (reduce False: not, for a timing)"""
    assert M % 128 == 0 and N % SPLITK_BN == 0 and K % 64 == 0 and 1 <= splits <= K // 64, (M, N, K, splits)
    map_a, map_b = maps or splitk_maps(a, b, M, N, K)
    units = M // 128 * (N // SPLITK_BN) * splits
    shared = SPLITK_STAGES * (128 + SPLITK_BN) * 128 + 1024 + 16 * SPLITK_STAGES
    launch(module, SPLITK, (min(blocks or nc.gpu.sms, units), 1, 1), 384, shared, nc.ptr_arg(partials), map_a, map_b,
           nc.int_arg(M), nc.int_arg(N), nc.int_arg(K), nc.int_arg(splits))
    if reduce:
        launch(module, "splitk_reduce_add", (-(-M * N // 1024), 1, 1), 256, 0, nc.ptr_arg(c), nc.ptr_arg(partials),
               nc.int_arg(M * N), nc.int_arg(splits))


def timed(run, reps=20):
    """median us of run() over reps, CUDA events around each, after 3 to warm up"""
    cu, check, gpu = nc.cu, nc.check, nc.gpu
    ev = [check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2)]
    for _ in range(3):
        run()
    times = []
    for _ in range(reps):
        check(cu.cuEventRecord(ev[0], gpu.stream), "cuEventRecord")
        run()
        check(cu.cuEventRecord(ev[1], gpu.stream), "cuEventRecord")
        gpu.sync()
        times.append(check(cu.cuEventElapsedTime(ev[0], ev[1]), "cuEventElapsedTime") * 1000)
    return float(np.median(times))


CHECK = (512, 768, 768)       # M, N, K of the product checked against numpy before the timings
CHECK_TN = (384, 512, 4096)   # the weight gradient's: 6 tiles x 3 splits on 5 blocks

# the big model's forward products at batch 64 x 512 (x @ w.T): name, M, N, K
PRODUCTS = [("wqkv", 32768, 1280, 768), ("wo", 32768, 768, 768), ("w_gate_up", 32768, 4096, 768),
            ("w_down", 32768, 768, 2048)]
# the backward's (nanoeuler_cuda run_backward): data gradients dx (N_tok, K_in) = dy (N_tok, N_out) @ w (N_out, K_in)
# as M, N, K; weight gradients dw (N_out, K_in) += dy.T @ x, M = N_out, N = K_in, K = the tokens
DATA_GRADIENTS = [("wqkv", 32768, 768, 1280), ("wo", 32768, 768, 768), ("w_gate_up", 32768, 768, 4096),
                  ("w_down", 32768, 2048, 768)]
WEIGHT_GRADIENTS = [("wqkv", 1280, 768, 32768), ("wo", 768, 768, 32768), ("w_gate_up", 4096, 768, 32768),
                    ("w_down", 768, 2048, 32768)]


def timing_operand(rng, shape):
    """a timing's operand as bf16 bits: 2^20 normal numbers repeated to fill the shape (drawing all of a 32768 x 4096
    operand takes tens of seconds on the host; the tensor cores' time does not depend on the values)"""
    pool = bf16_bits(rng.standard_normal(size=min(1 << 20, int(np.prod(shape))), dtype=np.float32))
    return np.resize(pool, shape)


def print_table(us, products, rows):
    """a row a kernel (rows: (kernel, label)), a column a product: us a call (TFLOP/s), cuBLAS's time over it"""
    print(f"{'us a call (TFLOP/s)':<34}" + "".join(f"{f'{n} {M}x{N}x{K}':>26}" for n, M, N, K in products))
    for kernel, column in rows:
        cells = [f"{us[kernel, n]:7.1f} ({2 * M * N * K / us[kernel, n] / 1e6:3.0f}) "
                 f"{us['cuBLAS', n] / us[kernel, n]:4.2f}x" for n, M, N, K in products]
        print(f"{column:<34}" + "".join(f"{cell:>26}" for cell in cells), flush=True)
    print("(median of 20; x: cuBLAS's time over this one's, same run)")


def report(name, shape, c, ref, bound):
    """one check's line -> whether c is within ROOM times its bound"""
    err = np.abs(c - ref)
    ratio = np.nanmax(err / bound) if np.isfinite(err).all() else np.inf
    print(f"{name:<40} {' x '.join(map(str, shape))}  max error {np.max(err):9.2e}  / bound {ratio:8.2f}  "
          f"{'OK' if ratio <= ROOM else 'NOT OK'}", flush=True)
    return ratio <= ROOM


def check_and_time_products(module):
    """-> whether the probe's product is within its bound; prints its check and the timings"""
    rng = np.random.default_rng(0)
    M, N, K = CHECK
    a, b = bf16_bits(rng.normal(size=(M, K))), bf16_bits(rng.normal(size=(N, K)))
    A, B = from_bf16(a).astype(np.float64), from_bf16(b).astype(np.float64).T
    ref, ok = A @ B, True
    da, db = nc.to_gpu(a, np.uint16), nc.to_gpu(b, np.uint16)
    for name, product, _ in GEMMS:
        if name in TIMING_ONLY:
            continue
        c = nc.DeviceArray((M, N), np.uint16)
        c.fill_bits(0xFFFF)                                    # NaN: what the kernel does not write shows
        product(module, c, da, db, M, N, K, blocks=5)
        nc.gpu.sync()
        err = np.abs(from_bf16(c.download()) - ref)
        ratio = np.nanmax(err / (fp32_bound(A, B) + 2.0 ** -8 * np.abs(ref))) if np.isfinite(err).all() else np.inf
        ok &= ratio <= ROOM
        print(f"{name:<40} {M} x {N} x {K}  max error {np.max(err):9.2e}  / bound {ratio:8.2f}  "
              f"{'OK' if ratio <= ROOM else 'NOT OK'}", flush=True)
    nc.gpu.precision, nc.gpu.cublas = "bf16", nc.Cublas(nc.gpu.stream)
    # a row a kernel, a column a product: us a call (TFLOP/s), cuBLAS first, each x its time
    us = {}
    for name, M, N, K in PRODUCTS:
        a = nc.to_gpu(bf16_bits(rng.normal(size=(M, K))), np.uint16)
        b = nc.to_gpu(bf16_bits(rng.normal(size=(N, K))), np.uint16)
        c = nc.DeviceArray((M, N), np.uint16)
        us["cuBLAS", name] = timed(lambda: nc.gpu.cublas.gemm(c, a, b, M, N, K, trans_b=True))
        for kernel, product, _ in GEMMS:
            maps = tma_maps(kernel, c, a, b, M, N, K) if kernel in TMA_GEMMS else None
            run = (lambda kernel=kernel, maps=maps: tma_gemm(module, kernel, c, a, b, M, N, K, maps)) if maps else \
                (lambda product=product: product(module, c, a, b, M, N, K))
            us[kernel, name] = timed(run)
    print_table(us, PRODUCTS, [("cuBLAS", "cuBLAS"), *((kernel, column) for kernel, _, column in GEMMS)])
    return ok


def check_and_time_backward(module):
    """-> whether the backward's products are within their bounds; prints their checks and timings beside cuBLAS
    called as run_backward calls it (matmul(dx, dy, w, ...) and matmul(dw, dy, x, ..., trans_a=True,
    accumulate=True))"""
    rng, ok = np.random.default_rng(1), True
    M, N, K = CHECK
    a, b = bf16_bits(rng.normal(size=(M, K))), bf16_bits(rng.normal(size=(K, N)))
    A, B = from_bf16(a).astype(np.float64), from_bf16(b).astype(np.float64)
    ref, da, db = A @ B, nc.to_gpu(a, np.uint16), nc.to_gpu(b, np.uint16)
    for name in NN_GEMMS:
        c = nc.DeviceArray((M, N), np.uint16).fill_bits(0xFFFF)   # NaN: what the kernel does not write shows
        tma_gemm(module, name, c, da, db, M, N, K, blocks=5)
        ok &= report(name, CHECK, from_bf16(c.download()), ref, fp32_bound(A, B) + 2.0 ** -8 * np.abs(ref))
    M, N, K = CHECK_TN
    a, b = bf16_bits(rng.normal(size=(K, M))), bf16_bits(rng.normal(size=(K, N)))
    c0 = rng.normal(size=(M, N)).astype(np.float32)
    A, B = from_bf16(a).astype(np.float64), from_bf16(b).astype(np.float64)
    ref = c0 + A.T @ B
    c, partials = nc.to_gpu(c0), nc.DeviceArray((3, M, N)).fill_bits(0x7FC00000)
    splitk_tn(module, c, nc.to_gpu(a, np.uint16), nc.to_gpu(b, np.uint16), M, N, K, partials, 3, blocks=5)
    c1 = c.download()
    ok &= report(SPLITK + " (3 splits)", CHECK_TN, c1, ref,
                 fp32_bound(A.T, B) + 2.0 ** -23 * (np.abs(c0) + np.abs(A.T) @ np.abs(B)))
    # no atomics: the same bits again on one block an SM (other blocks making each partial)
    c = nc.to_gpu(c0)
    splitk_tn(module, c, nc.to_gpu(a, np.uint16), nc.to_gpu(b, np.uint16), M, N, K, partials, 3)
    same = np.array_equal(c.download().view(np.uint32), c1.view(np.uint32))
    ok &= same
    print(f"{SPLITK + ' (3 splits)':<40} same bits on 5 blocks and on {nc.gpu.sms}: {'OK' if same else 'NOT OK'}")
    us = {}
    for name, M, N, K in DATA_GRADIENTS:
        a, b = nc.to_gpu(timing_operand(rng, (M, K)), np.uint16), nc.to_gpu(timing_operand(rng, (K, N)), np.uint16)
        c = nc.DeviceArray((M, N), np.uint16)
        us["cuBLAS", name] = timed(lambda: nc.gpu.cublas.gemm(c, a, b, M, N, K))
        for kernel in NN_GEMMS:
            maps = tma_maps(kernel, c, a, b, M, N, K)
            us[kernel, name] = timed(lambda kernel=kernel, maps=maps: tma_gemm(module, kernel, c, a, b, M, N, K, maps))
    print("the data gradients, c (M, N) bf16 = a (M, K) @ b (K, N)")
    print_table(us, DATA_GRADIENTS, [("cuBLAS", "cuBLAS"), *((k, k.replace("wgmma_", "")) for k in NN_GEMMS)])
    us, splits = {}, {}
    for name, M, N, K in WEIGHT_GRADIENTS:
        a, b = nc.to_gpu(timing_operand(rng, (K, M)), np.uint16), nc.to_gpu(timing_operand(rng, (K, N)), np.uint16)
        c = nc.DeviceArray((M, N)).zero()
        us["cuBLAS", name] = timed(lambda: nc.gpu.cublas.gemm(c, a, b, M, N, K, trans_a=True, accumulate=True))
        splits[name] = splits_for(M, N, K, nc.gpu.sms)
        partials = nc.DeviceArray((splits[name], M, N))
        maps = splitk_maps(a, b, M, N, K)
        us[SPLITK, name] = timed(lambda: splitk_tn(module, c, a, b, M, N, K, partials, splits[name], maps))
        us["no reduce", name] = timed(lambda: splitk_tn(module, c, a, b, M, N, K, partials, splits[name], maps,
                                                        reduce=False))
        for s in SPLIT_SWEEP:                                  # other splits, to see how far splits_for is off
            partials = nc.DeviceArray((s, M, N))
            us[f"splits {s}", name] = timed(lambda: splitk_tn(module, c, a, b, M, N, K, partials, s, maps))
    print("the weight gradients, c (M, N) fp32 += a.T @ b, a (K, M), b (K, N); splits " +
          ", ".join(f"{name} {s}" for name, s in splits.items()))
    print_table(us, WEIGHT_GRADIENTS, [("cuBLAS", "cuBLAS"), (SPLITK, "tma_splitk_tn_bn256 + reduce"),
                                       ("no reduce", "tma_splitk_tn_bn256 alone"),
                                       *((f"splits {s}", f"  {s} splits + reduce") for s in SPLIT_SWEEP)])
    return ok


def open_device():
    """GPU 0, its primary context made current and a stream, as nanoeuler_cuda.GPU makes them -> (device, context,
    stream)"""
    nc.count_gpus()
    cu, check = nc.cu, nc.check
    dev = check(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return dev, ctx, check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")


def start_gpu():
    """nanoeuler_cuda's GPU on GPU 0 without compiling its kernels: its arch, name and SMs from the driver"""
    gpu = object.__new__(nc.GPU)
    gpu.dev, gpu.ctx, gpu.stream = open_device()
    cu, check = nc.cu, nc.check
    attr = cu.CUdevice_attribute
    major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, gpu.dev), "attr")
    minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, gpu.dev), "attr")
    gpu.sms = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, gpu.dev), "attr")
    gpu.arch = f"{major}{minor}"
    gpu.name = check(cu.cuDeviceGetName(256, gpu.dev), "cuDeviceGetName").split(b"\0")[0].decode()
    gpu.last_kernel, gpu.profile = None, None
    nc.gpu = gpu
    return gpu


def main():
    gpu = start_gpu()
    cu, check = nc.cu, nc.check
    if gpu.arch != "90":
        sys.exit(f"wgmma needs sm_90a (an H100 or H200); this is {gpu.name}, sm_{gpu.arch}")
    _, nvrtc = nc.import_cuda()
    print(f"{gpu.name}, NVRTC {'.'.join(map(str, nvrtc.nvrtcVersion()[1:]))}, sm_90a")
    with open(os.path.join(HERE, "wgmma_probe.cu")) as f:
        module = check(cu.cuModuleLoadData(nc.nvrtc_compile("wgmma_probe.cu", f.read(), "90a")), "loading the probe")
    bad = 0
    for name, (N, K, a_mn, b_mn) in VARIANTS.items():
        a, b, A, B = operands(N, K, a_mn, b_mn, seed=len(name))
        c = nc.DeviceArray((64, N))
        c.fill_bits(0x7FC00000)                              # NaN: what the kernel does not write shows
        da, db = nc.to_gpu(a, np.uint16), nc.to_gpu(b, np.uint16)
        launch(module, name, (1, 1, 1), 128, (64 + N) * 2 * K + 1024, nc.ptr_arg(c), nc.ptr_arg(da), nc.ptr_arg(db),
               nc.int_arg(K))
        gpu.sync()
        err = np.abs(c.download() - A @ B)
        ratio = np.nanmax(err / fp32_bound(A, B)) if np.isfinite(err).all() else np.inf
        ok = ratio <= ROOM
        bad += not ok
        print(f"{name:<40} N {N:3} K {K:3}  max error {np.max(err):9.2e}  / fp32 bound {ratio:8.2f}  "
              f"{'OK' if ok else 'NOT OK'}", flush=True)
    bad += not check_and_time_products(module)
    bad += not check_and_time_backward(module)
    print("all OK" if not bad else f"{bad} NOT OK")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
