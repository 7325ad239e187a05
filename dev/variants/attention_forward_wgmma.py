"""
Runs dev/variants/attention_forward_wgmma.cu (the bf16 attention forward at D = 64 with Hopper's
warpgroup MMA, issue 36) on an H100 or H200 (sm_90a) beside the product's forward
(flash_attn.cu's attention_forward_bf16_kernel_64, launched as nanoeuler_cuda.attention_forward
launches it). Not part of NanoEuler.

    python dev/variants/attention_forward_wgmma.py

First the product and each version of the variant (simple, overlapped or pipelined, 64 or 128 keys a step,
a block a unit of work or one block an SM walking units: VERSIONS) at the big model's shape (B 64, T 512,
Hq 12, Hkv 4, D 64; causal, GQA) on the same random qkv: y and lse of one batch row against numpy in
float64 (relative norm of the error), every element of y and lse written and finite; OK within Y_BOUND and
LSE_BOUND (the product's own errors are about 2e-3 and 3e-5). Then the timings at batch 64 and 16: us a
call, the median of REPS runs of 20 launches, CUDA events around each run, after a warm-up, and each over
the product's. Last, "all OK" or how many were not (exit code 1). test_attention_wgmma.py runs this host
code on the CPU emulator's stand-in driver at a small shape, and the versions against float64 there.
"""

import ctypes
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
import nanoeuler_cuda as nc                                    # noqa: E402

D = 64
CHECK = (64, 512, 12, 4)          # B, T, Hq, Hkv of the check (one batch row against float64: the last)
BATCHES = (64, 16)                # timed at these B, T and heads as CHECK
LAUNCHES, REPS = 20, 11           # us a call: the median of REPS runs of LAUNCHES launches
Y_BOUND, LSE_BOUND = 4e-3, 1e-4   # OK: relative norm of the error against float64 within these
PRODUCT = "attention_forward_bf16_kernel_64"
# the variant's versions: entry point, keys a step, K/V stages (dynamic shared memory 3 W 8 KB + STAGES 256 KEYS
# bytes + 1 KB), and whether persistent (a block an SM, each walking units gridDim.x apart) or a block a unit
# (q: q read by s = q k.T from registers, not shared memory; k128: 128 keys a step)
ENTRIES = {"wgmma": ("attention_forward_wgmma_64", 64, 3),
           "wgmma q": ("attention_forward_wgmma_qr_64", 64, 3),
           "wgmma overlap": ("attention_forward_wgmma_overlap_64", 64, 4),
           "wgmma pipelined": ("attention_forward_wgmma_pipelined_64", 64, 4),
           "wgmma pipelined q": ("attention_forward_wgmma_pipelined_qr_64", 64, 4),
           "wgmma k128": ("attention_forward_wgmma_k128_64", 128, 3),
           "wgmma k128 q": ("attention_forward_wgmma_k128_qr_64", 128, 3)}

VERSIONS = {name + persistent: (*entry, bool(persistent))
            for name, entry in ENTRIES.items() for persistent in ("", " persistent")}


def bf16_bits(x):
    """float32 -> bf16 bits, rounded to nearest even (x has no NaN)"""
    u = np.asarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + (u >> 16 & 1)) >> 16).astype(np.uint16)


def from_bf16(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def random_qkv(B, T, Hq, Hkv, seed=0):
    """bf16 bits of qkv (B T, (Hq + 2 Hkv) D), normal: scores of about unit size after the scale"""
    return bf16_bits(np.random.default_rng(seed).normal(size=(B * T, (Hq + 2 * Hkv) * D)))


def reference(qkv, b, T, Hq, Hkv):
    """y (T, Hq D) and lse (Hq, T) of batch row b in float64, from qkv's bf16 values"""
    x = from_bf16(qkv.reshape(-1, T, (Hq + 2 * Hkv) * D)[b]).astype(np.float64)
    q = x[:, :Hq * D].reshape(T, Hq, D)
    k = x[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D)
    v = x[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
    y, lse = np.empty((T, Hq, D)), np.empty((Hq, T))
    future = np.triu(np.ones((T, T), bool), 1)
    for h in range(Hq):
        kvh = h // (Hq // Hkv)
        s = q[:, h] @ k[:, kvh].T / math.sqrt(D)
        s[future] = -np.inf
        mx = s.max(axis=1, keepdims=True)
        e = np.exp(s - mx)
        lse[h] = (mx + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
        y[:, h] = e / e.sum(axis=1, keepdims=True) @ v[:, kvh]
    return y.reshape(T, Hq * D), lse


def relative_error(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref)) if np.isfinite(x).all() else math.inf


def warpgroups(Hq, Hkv):
    """query heads a block of the variant: the largest divisor of Hq / Hkv up to 3 (one warpgroup each)"""
    return max(w for w in (1, 2, 3) if (Hq // Hkv) % w == 0)


def units(B, T, Hq, Hkv):
    """the variant's units of work: pairs of 64-row query tiles of W query heads of a batch row"""
    return B * (Hq // warpgroups(Hq, Hkv)) * ((-(-T // 64) + 1) // 2)


def launch(module, name, grid, block, shared, *args):
    cu, check = nc.cu, nc.check
    f = check(cu.cuModuleGetFunction(module, name.encode()), name)
    check(cu.cuFuncSetAttribute(f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
          "cuFuncSetAttribute")
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(x) for x in args])
    nc.gpu.last_kernel = name
    check(cu.cuLaunchKernel(f, *grid, block, 1, 1, shared, nc.gpu.stream, ctypes.addressof(params), 0), name)


def forward(modules, name, y, lse, qkv, B, T, Hq, Hkv):
    """one launch of a version of the variant, or (name PRODUCT) of the product's forward as
    nanoeuler_cuda.attention_forward launches it"""
    scale = nc.float_arg(1 / math.sqrt(D))
    if name == PRODUCT:
        rows = nc.ATTENTION_ROWS * nc.FORWARD_MT[D]
        launch(modules["product"], name, (Hq, B, -(-T // rows)), 128, 0, nc.ptr_arg(y), nc.ptr_arg(lse),
               nc.ptr_arg(qkv), nc.int_arg(T), nc.int_arg(Hq), nc.int_arg(Hkv), scale)
    else:
        entry, keys, stages, persistent = VERSIONS[name]
        W, n = warpgroups(Hq, Hkv), units(B, T, Hq, Hkv)
        launch(modules["variant"], entry, (min(n, nc.gpu.sms) if persistent else n, 1, 1), 128 * W,
               3 * W * 8192 + stages * 256 * keys + 1024, nc.ptr_arg(y), nc.ptr_arg(lse), nc.ptr_arg(qkv),
               nc.int_arg(B), nc.int_arg(T), nc.int_arg(Hq), nc.int_arg(Hkv), scale)


def timed(run, reps=REPS):
    """median us of run() over reps, CUDA events around each, after one to warm up"""
    cu, check, gpu = nc.cu, nc.check, nc.gpu
    ev = [check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2)]
    run()
    times = []
    for _ in range(reps):
        check(cu.cuEventRecord(ev[0], gpu.stream), "cuEventRecord")
        run()
        check(cu.cuEventRecord(ev[1], gpu.stream), "cuEventRecord")
        gpu.sync()
        times.append(check(cu.cuEventElapsedTime(ev[0], ev[1]), "cuEventElapsedTime") * 1000)
    return float(np.median(times))


def check_versions(modules):
    """-> how many versions (the product's as well) are not OK at CHECK; prints each one's errors"""
    B, T, Hq, Hkv = CHECK
    qkv = random_qkv(B, T, Hq, Hkv)
    y_ref, lse_ref = reference(qkv, B - 1, T, Hq, Hkv)
    dqkv = nc.to_gpu(qkv, np.uint16)
    y, lse = nc.DeviceArray((B * T, Hq * D), np.uint16), nc.DeviceArray((B, Hq, T))
    bad = 0
    for name in [PRODUCT, *VERSIONS]:
        y.fill_bits(0xFFFF)                                    # NaN: what a kernel does not write shows
        lse.fill_bits(0x7FC00000)
        forward(modules, name, y, lse, dqkv, B, T, Hq, Hkv)
        nc.gpu.sync()
        ys, lses = from_bf16(y.download()), lse.download()
        written = np.isfinite(ys).all() and np.isfinite(lses).all()
        ey = relative_error(ys.reshape(B, T, -1)[B - 1].astype(np.float64), y_ref)
        el = relative_error(lses[B - 1].astype(np.float64), lse_ref)
        ok = written and ey <= Y_BOUND and el <= LSE_BOUND
        bad += not ok
        print(f"{name:<36} B {B} T {T} Hq {Hq} Hkv {Hkv}: y {ey:9.2e}  lse {el:9.2e}  "
              f"{'all written' if written else 'NOT ALL WRITTEN'}  {'OK' if ok else 'NOT OK'}", flush=True)
    return bad


def time_versions(modules):
    _, T, Hq, Hkv = CHECK
    names = [PRODUCT, *VERSIONS]
    print(f"{'us a call':<36} " + " ".join(f"{'B %d' % B:>16}" for B in BATCHES))
    table = {name: [] for name in names}
    for B in BATCHES:
        qkv = nc.to_gpu(random_qkv(B, T, Hq, Hkv, seed=B), np.uint16)
        y, lse = nc.DeviceArray((B * T, Hq * D), np.uint16), nc.DeviceArray((B, Hq, T))
        for name in names:
            def run(name=name):
                for _ in range(LAUNCHES):
                    forward(modules, name, y, lse, qkv, B, T, Hq, Hkv)
            table[name].append(timed(run) / LAUNCHES)
    for name in names:
        ratios = [t / p for t, p in zip(table[name], table[PRODUCT])]
        print(f"{name:<36} " + " ".join(f"{t:8.1f} ({r:4.2f}x)" for t, r in zip(table[name], ratios)), flush=True)
    print(f"(median of {REPS} runs of {LAUNCHES} launches; x: of the product's time)")


def start_gpu():
    """a context and stream on GPU 0, as nanoeuler_cuda.GPU makes them, without compiling its kernels"""
    nc.count_gpus()
    cu, check = nc.cu, nc.check
    gpu = object.__new__(nc.GPU)
    gpu.dev = check(cu.cuDeviceGet(0), "cuDeviceGet")
    gpu.ctx = check(cu.cuDevicePrimaryCtxRetain(gpu.dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(gpu.ctx), "cuCtxSetCurrent")
    gpu.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
    attr = cu.CUdevice_attribute
    major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, gpu.dev), "attr")
    minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, gpu.dev), "attr")
    gpu.arch = f"{major}{minor}"
    gpu.name = check(cu.cuDeviceGetName(256, gpu.dev), "cuDeviceGetName").split(b"\0")[0].decode()
    gpu.sms = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, gpu.dev), "attr")
    gpu.last_kernel, gpu.profile = None, None
    nc.gpu = gpu
    return gpu


def main():
    gpu = start_gpu()
    cu, check = nc.cu, nc.check
    if gpu.arch != "90":
        sys.exit(f"wgmma needs sm_90a (an H100 or H200); this is {gpu.name}, sm_{gpu.arch}")
    _, nvrtc = nc.import_cuda()
    print(f"{gpu.name} ({gpu.sms} SMs), NVRTC {'.'.join(map(str, nvrtc.nvrtcVersion()[1:]))}")
    modules = {}
    for key, file, arch in (("variant", os.path.join(HERE, "attention_forward_wgmma.cu"), "90a"),
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
