"""
Runs dev/variants/attention_forward_tma.cu (a FlashAttention-3-style bf16 attention forward at D = 64: wgmma fed by
TMA, a producer warpgroup and a consumer warpgroup per query head, issue 36) on an H100 or H200 (sm_90a) beside
the product's forward (flash_attn.cu's attention_forward_bf16_kernel_64, launched as
nanoeuler_cuda.attention_forward launches it). Not part of NanoEuler.

    python dev/variants/attention_forward_tma.py

First the product and each version (VERSIONS: 64 or 128 keys a step, waited for at once or overlapped, a block a
unit of work or one block an SM walking units) at the big model's shape (B 64, T 512, Hq 12, Hkv 4, D 64; causal,
GQA) on the same random qkv, and once more at T 320 (a T with an odd number of query tiles, which a 128-key step
does not divide): y and lse of one batch row against numpy in float64 (relative norm of the error), every element
of y and lse written and finite; OK within the bounds of attention_forward_wgmma.py (the product's own errors are
about 2e-3 and 3e-5). Then the timings at batch 64 and 16: us a call, the median of REPS runs of 20 launches,
CUDA events around each run, after a warm-up, and each over the product's; PROBES (timed, not checked) too.
Last, "all OK" or how many were not (exit code 1). A version still running 5 s after its launch hangs: named,
NOT OK, and the process ends (exit 3). test_attention_tma.py runs this host code on the CPU emulator's stand-in
driver at a small shape.
The helpers shared with attention_forward_wgmma.py (random qkv, the float64 reference, launches, timing) are its.
"""

import ctypes
import importlib.util
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
import nanoeuler_cuda as nc                                    # noqa: E402

_spec = importlib.util.spec_from_file_location("attention_forward_wgmma", os.path.join(HERE,
                                                                                       "attention_forward_wgmma.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
D, PRODUCT, Y_BOUND, LSE_BOUND = base.D, base.PRODUCT, base.Y_BOUND, base.LSE_BOUND
bf16_bits, from_bf16, random_qkv, reference, relative_error = (base.bf16_bits, base.from_bf16, base.random_qkv,
                                                               base.reference, base.relative_error)

CHECKS = ((64, 512, 12, 4), (4, 320, 12, 4))   # B, T, Hq, Hkv of the checks (one batch row against float64: the last)
BATCHES = (64, 16)                # timed at these B, T and heads as CHECKS[0]
LAUNCHES, REPS = 20, 11           # us a call: the median of REPS runs of LAUNCHES launches
# the versions: entry point, keys a step (BN), K/V stages, and whether persistent (a block an SM, each walking units
# gridDim.x apart) or a block a unit
VERSIONS = {"tma 64": ("attention_forward_tma_64", 64, 6, False),
            "tma 64 persistent": ("attention_forward_tma_64", 64, 6, True),
            "tma 128": ("attention_forward_tma_128", 128, 4, False),
            "tma 128 persistent": ("attention_forward_tma_128", 128, 4, True),
            "tma 64 overlap": ("attention_forward_tma_overlap_64", 64, 6, False),
            "tma 64 overlap persistent": ("attention_forward_tma_overlap_64", 64, 6, True),
            "tma 64 pipelined": ("attention_forward_tma_pipelined_64", 64, 6, False),
            "tma 64 pipelined persistent": ("attention_forward_tma_pipelined_64", 64, 6, True),
            "tma 128 pipelined": ("attention_forward_tma_pipelined_128", 128, 4, False),
            "tma 128 pipelined persistent": ("attention_forward_tma_pipelined_128", 128, 4, True),
            "tma 64 pipelined q": ("attention_forward_tma_pipelined_qr_64", 64, 6, False),
            "tma 64 pipelined q persistent": ("attention_forward_tma_pipelined_qr_64", 64, 6, True),
            "tma 128 pipelined turns": ("attention_forward_tma_pipelined_turns_128", 128, 4, False),
            "tma 128 pipelined turns persistent": ("attention_forward_tma_pipelined_turns_128", 128, 4, True),
            "tma 64 pipelined q turns": ("attention_forward_tma_pipelined_qr_turns_64", 64, 6, False),
            "tma 64 pipelined q turns persistent": ("attention_forward_tma_pipelined_qr_turns_64", 64, 6, True),
            "tma 64 pipelined turns persistent": ("attention_forward_tma_pipelined_turns_64", 64, 6, True),
            "tma 128 pipelined turns half persistent": ("attention_forward_tma_pipelined_turns_half_128", 128, 4, True),
            "tma 128 pipelined turns poly persistent": ("attention_forward_tma_pipelined_turns_poly_128", 128, 4, True)}
# probes of what bounds the fastest version, timed but not checked (their y and lse are wrong): its consumers
# without the softmax, the copies and stores alone, its consumers without the wgmma
PROBES = {"probe: no softmax (128 turns persistent)": ("attention_forward_tma_probe_no_softmax_128", 128, 4, True),
          "probe: copies and stores only (128)": ("attention_forward_tma_probe_copies_128", 128, 4, True),
          "probe: no wgmma (128 turns persistent)": ("attention_forward_tma_probe_no_wgmma_128", 128, 4, True)}


def warpgroups(Hq, Hkv):
    """consumer warpgroups (query heads) a block: the largest divisor of Hq / Hkv up to 3"""
    return max(w for w in (1, 2, 3) if (Hq // Hkv) % w == 0)


def units(B, T, Hq, Hkv):
    """the units of work: pairs of 64-row query tiles of W query heads of a batch row"""
    return B * (Hq // warpgroups(Hq, Hkv)) * ((-(-T // 64) + 1) // 2)


def shared_bytes(W, BN, stages):
    """dynamic shared memory: two q buffers of W tiles, the K/V stages, 1024 to align them, the mbarriers"""
    return 2 * W * 8192 + stages * 256 * BN + 1024 + 8 * (3 * stages + 4)


def tensor_map(cu, address, dtype, rows, cols, box_cols, box_rows, swizzle):
    """a CUtensorMap of the row-major matrix at address (rows, cols), boxes of box_cols x box_rows, as 128 bytes to
    pass by value (cu: the driver, or the emulator's)"""
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t                    # (cuda-python takes no plain ints for these)
    size = 2 if dtype == cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 else 4
    m = nc.check(cu.cuTensorMapEncodeTiled(dtype, 2, address, [u64(cols), u64(rows)], [u64(cols * size)],
                                           [u32(box_cols), u32(box_rows)], [u32(1), u32(1)],
                                           cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                           cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                           cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                 "cuTensorMapEncodeTiled")
    return (ctypes.c_uint64 * 16)(*[int(w) for w in m.opaque])


def arguments(cu, name, y, lse, qkv, B, T, Hq, Hkv):
    """-> (entry, grid, threads, shared bytes, the arguments as ctypes values) of a version; y, lse, qkv: addresses"""
    entry, BN, stages, persistent = {**VERSIONS, **PROBES}[name]
    W, n = warpgroups(Hq, Hkv), units(B, T, Hq, Hkv)
    rows, cols = B * T, (Hq + 2 * Hkv) * D
    bf16 = cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    sw128 = cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    args = [ctypes.c_void_p(y), ctypes.c_void_p(lse), tensor_map(cu, qkv, bf16, rows, cols, 64, 64, sw128),
            tensor_map(cu, qkv, bf16, rows, cols, 64, BN, sw128), ctypes.c_int(B), ctypes.c_int(T), ctypes.c_int(Hq),
            ctypes.c_int(Hkv),
            ctypes.c_float(1 / math.sqrt(D))]
    return entry, min(n, nc.gpu.sms) if persistent else n, 128 * (W + 1), shared_bytes(W, BN, stages), args


def forward(modules, name, y, lse, qkv, B, T, Hq, Hkv, prepared=None):
    """one launch of a version, or (name PRODUCT) of the product's forward as nanoeuler_cuda.attention_forward
    launches it; prepared: arguments() made once, for a timing"""
    if name == PRODUCT:
        base.forward(modules, name, y, lse, qkv, B, T, Hq, Hkv)
        return
    entry, grid, threads, shared, args = prepared or arguments(nc.cu, name, y.ptr, lse.ptr, qkv.ptr, B, T, Hq, Hkv)
    base.launch(modules["variant"], entry, (grid, 1, 1), threads, shared, *args)


def finish(name, seconds=5):
    """wait for the stream; a kernel still running after `seconds` hangs (a wait on its barriers that nothing
    completes, which no timeout ends on a GPU): say which, and end the process"""
    cu, deadline = nc.cu, time.time() + seconds
    while True:
        err = cu.cuStreamQuery(nc.gpu.stream)[0]
        if err != cu.CUresult.CUDA_ERROR_NOT_READY:
            nc.check((err,), name)
            return
        if time.time() > deadline:
            print(f"{name} HANGS: still running after {seconds} s; NOT OK", flush=True)
            os._exit(3)
        time.sleep(0.001)


def check_versions(modules):
    """-> how many versions (the product's as well) are not OK at CHECKS; prints each one's errors"""
    bad = 0
    for B, T, Hq, Hkv in CHECKS:
        qkv = random_qkv(B, T, Hq, Hkv)
        y_ref, lse_ref = reference(qkv, B - 1, T, Hq, Hkv)
        dqkv = nc.to_gpu(qkv, np.uint16)
        y, lse = nc.DeviceArray((B * T, Hq * D), np.uint16), nc.DeviceArray((B, Hq, T))
        for name in [PRODUCT, *VERSIONS]:
            y.fill_bits(0xFFFF)                                    # NaN: what a kernel does not write shows
            lse.fill_bits(0x7FC00000)
            forward(modules, name, y, lse, dqkv, B, T, Hq, Hkv)
            finish(name)
            ys, lses = from_bf16(y.download()), lse.download()
            written = np.isfinite(ys).all() and np.isfinite(lses).all()
            ey = relative_error(ys.reshape(B, T, -1)[B - 1].astype(np.float64), y_ref)
            el = relative_error(lses[B - 1].astype(np.float64), lse_ref)
            ok = written and ey <= Y_BOUND and el <= LSE_BOUND
            bad += not ok
            print(f"{name:<41} B {B:>2} T {T} Hq {Hq} Hkv {Hkv}: y {ey:9.2e}  lse {el:9.2e}  "
                  f"{'all written' if written else 'NOT ALL WRITTEN'}  {'OK' if ok else 'NOT OK'}", flush=True)
    return bad


def time_versions(modules):
    _, T, Hq, Hkv = CHECKS[0]
    names = [PRODUCT, *VERSIONS, *PROBES]
    print(f"{'us a call':<41} " + " ".join(f"{'B %d' % B:>16}" for B in BATCHES))
    table = {name: [] for name in names}
    for B in BATCHES:
        qkv = nc.to_gpu(random_qkv(B, T, Hq, Hkv, seed=B), np.uint16)
        y, lse = nc.DeviceArray((B * T, Hq * D), np.uint16), nc.DeviceArray((B, Hq, T))
        for name in names:
            prepared = None if name == PRODUCT else arguments(nc.cu, name, y.ptr, lse.ptr, qkv.ptr, B, T, Hq, Hkv)

            def run(name=name, prepared=prepared):
                for _ in range(LAUNCHES):
                    forward(modules, name, y, lse, qkv, B, T, Hq, Hkv, prepared)
            table[name].append(base.timed(run, REPS) / LAUNCHES)
    for name in names:
        ratios = [t / p for t, p in zip(table[name], table[PRODUCT])]
        print(f"{name:<41} " + " ".join(f"{t:8.1f} ({r:4.2f}x)" for t, r in zip(table[name], ratios)), flush=True)
    print(f"(median of {REPS} runs of {LAUNCHES} launches; x: of the product's time)")


def main():
    gpu = base.start_gpu()
    cu, check = nc.cu, nc.check
    if gpu.arch != "90":
        sys.exit(f"wgmma and TMA need sm_90a (an H100 or H200); this is {gpu.name}, sm_{gpu.arch}")
    _, nvrtc = nc.import_cuda()
    print(f"{gpu.name} ({gpu.sms} SMs), NVRTC {'.'.join(map(str, nvrtc.nvrtcVersion()[1:]))}")
    modules = {}
    for key, file, arch in (("variant", os.path.join(HERE, "attention_forward_tma.cu"), "90a"),
                            ("product", os.path.join(ROOT, "flash_attn.cu"), gpu.arch)):
        with open(file) as f:
            cubin = nc.nvrtc_compile(os.path.basename(file), f.read(), arch)
        modules[key] = check(cu.cuModuleLoadData(cubin), f"loading {os.path.basename(file)}")
    bad = check_versions(modules)
    time_versions(modules)
    print("all OK" if not bad else f"{bad} NOT OK")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
