"""
Runs dev/variants/attention_backward_tma.cu (the dk/dv pass of the bf16 attention backward at D = 64 with
warpgroup MMA fed by TMA, issue 36) on an H100 or H200 (sm_90a) beside the product's dk/dv pass
(flash_attn.cu's attention_backward_dkv_bf16_kernel_64, launched as nanoeuler_cuda.attention_backward
launches it). Not part of NanoEuler.

    python dev/variants/attention_backward_tma.py

First, at the big model's shape (B 64, T 512, Hq 12, Hkv 4, D 64) and at B 4, T 320, on random qkv and dy, with
y and lse from the product's forward and delta from its delta kernel: dk and dv of the product's pass and of
each version, and dq from the product's dq pass on each one's ds, against numpy in float64 for the last batch
row (relative norm of the error; OK within DKV_BOUND, every element written and finite). Then the timings of
the dk/dv passes alone at batch 64 and 16: us a call, the median of REPS runs of 20 launches, each over the
product's. Last, "all OK" or how many were not (exit code 1). test_attention_backward_tma.py runs the versions
on the CPU emulator against float64.
"""

import ctypes
import importlib.util
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
import nanoeuler_cuda as nc                                    # noqa: E402

_spec = importlib.util.spec_from_file_location("attention_forward_tma", os.path.join(HERE, "attention_forward_tma.py"))
forward_tma = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(forward_tma)
base, tensor_map, finish = forward_tma.base, forward_tma.tensor_map, forward_tma.finish    # (finish: a hang named)
D, bf16_bits, from_bf16, random_qkv, relative_error = (base.D, base.bf16_bits, base.from_bf16, base.random_qkv,
                                                       base.relative_error)

CHECKS = ((64, 512, 12, 4), (4, 320, 12, 4))   # B, T, Hq, Hkv of the checks (the last batch row against float64)
BATCHES = (64, 16)                # timed at these B, T and heads as CHECKS[0]
LAUNCHES, REPS = 20, 11           # us a call: the median of REPS runs of LAUNCHES launches
DKV_BOUND = 1e-2                  # OK: relative norm of dk's, dv's and dq's errors against float64 within this
PRODUCT = "attention_backward_dkv_bf16_kernel_64"
W = 2                             # consumer warpgroups (key tiles) a block
# the versions: entry point, q/dy stages, and whether persistent (a block an SM, each walking units gridDim.x apart)
# or a block a unit
VERSIONS = {"tma dkv": ("attention_backward_dkv_tma_64", 4, False),
            "tma dkv persistent": ("attention_backward_dkv_tma_64", 4, True),
            "tma dkv kv": ("attention_backward_dkv_tma_kvr_64", 4, False),
            "tma dkv kv persistent": ("attention_backward_dkv_tma_kvr_64", 4, True),
            "tma dkv turns persistent": ("attention_backward_dkv_tma_turns_64", 4, True),
            "tma dkv kv turns persistent": ("attention_backward_dkv_tma_kvr_turns_64", 4, True)}
# the dq pass's versions: entry point, stages, persistent; run on the product's ds
DQ_PRODUCT = "attention_backward_dq_bf16_kernel_64"
DQ_VERSIONS = {"tma dq": ("attention_backward_dq_tma_64", 4, False),
               "tma dq persistent": ("attention_backward_dq_tma_64", 4, True)}


def random_dy(B, T, Hq, seed=1):
    """bf16 bits of dy (B T, Hq D), normal"""
    return bf16_bits(np.random.default_rng(seed).normal(size=(B * T, Hq * D)))


def reference(qkv, dy, b, T, Hq, Hkv):
    """dq, dk, dv (T, heads D) of batch row b in float64 from qkv's and dy's bf16 values; ds (Hq, T, T)"""
    x = from_bf16(qkv.reshape(-1, T, (Hq + 2 * Hkv) * D)[b]).astype(np.float64)
    g = from_bf16(dy.reshape(-1, T, Hq * D)[b]).astype(np.float64).reshape(T, Hq, D)
    q = x[:, :Hq * D].reshape(T, Hq, D)
    k = x[:, Hq * D:(Hq + Hkv) * D].reshape(T, Hkv, D)
    v = x[:, (Hq + Hkv) * D:].reshape(T, Hkv, D)
    scale, G = 1 / math.sqrt(D), Hq // Hkv
    dq, dk, dv, ds = np.zeros((T, Hq, D)), np.zeros((T, Hkv, D)), np.zeros((T, Hkv, D)), np.zeros((Hq, T, T))
    future = np.triu(np.ones((T, T), bool), 1)
    for h in range(Hq):
        kvh = h // G
        s = q[:, h] @ k[:, kvh].T * scale
        s[future] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        y = p @ v[:, kvh]
        dp = g[:, h] @ v[:, kvh].T
        ds[h] = p * (dp - (g[:, h] * y).sum(axis=1, keepdims=True))
        dv[:, kvh] += p.T @ g[:, h]
        dk[:, kvh] += scale * ds[h].T @ q[:, h]
        dq[:, h] = scale * ds[h] @ k[:, kvh]
    return dq.reshape(T, -1), dk.reshape(T, -1), dv.reshape(T, -1), ds


def shared_bytes(stages):
    """dynamic shared memory: W K and W V tiles, the stages' q and dy tiles, lse and delta, the mbarriers, 1024 to
    align the tiles"""
    return (2 * W + 2 * stages) * 8192 + 512 * stages + 8 * (2 * stages + 2) + 1024


def arguments(cu, name, dqkv, ds, qkv, dy, lse, delta, B, T, Hq, Hkv, sms):
    """-> (entry, grid, threads, shared bytes, the arguments as ctypes values) of a version; dqkv .. delta: addresses;
    sms: the blocks of a persistent version"""
    entry, stages, persistent = VERSIONS[name]
    types = cu.CUtensorMapDataType
    bf16, fp32 = types.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, types.CU_TENSOR_MAP_DATA_TYPE_FLOAT32
    sw128, none = cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
    args = [ctypes.c_void_p(dqkv), ctypes.c_void_p(ds),
            tensor_map(cu, qkv, bf16, B * T, (Hq + 2 * Hkv) * D, 64, 64, sw128),
            tensor_map(cu, dy, bf16, B * T, Hq * D, 64, 64, sw128),
            tensor_map(cu, lse, fp32, B * Hq, T, 64, 1, none), tensor_map(cu, delta, fp32, B * Hq, T, 64, 1, none),
            ctypes.c_int(B), ctypes.c_int(T), ctypes.c_int(Hq), ctypes.c_int(Hkv), ctypes.c_float(1 / math.sqrt(D))]
    nk = -(-T // 64)                                           # key tiles; a unit is W of them
    units = -(-nk // W) * B * Hkv
    return entry, (min(units, sms) if persistent else units, 1, 1), 128 * (W + 1), shared_bytes(stages), args


def dq_warpgroups(Hq, Hkv):
    """query heads (consumer warpgroups) a block of the dq pass: the largest divisor of Hq / Hkv up to 3"""
    return max(w for w in (1, 2, 3) if (Hq // Hkv) % w == 0)


def dq_arguments(cu, name, dqkv, qkv, ds, B, T, Hq, Hkv, sms):
    """-> (entry, grid, threads, shared bytes, the arguments as ctypes values) of a dq version"""
    entry, stages, persistent = DQ_VERSIONS[name]
    Wq, nq = dq_warpgroups(Hq, Hkv), -(-T // 64)
    bf16 = cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    sw128, none = cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
    args = [ctypes.c_void_p(dqkv), tensor_map(cu, qkv, bf16, B * T, (Hq + 2 * Hkv) * D, 64, 64, sw128),
            tensor_map(cu, ds, bf16, nc.attention_ds_size(B, T, Hq) // 64, 64, 64, 64, none),
            ctypes.c_int(B), ctypes.c_int(T), ctypes.c_int(Hq), ctypes.c_int(Hkv), ctypes.c_float(1 / math.sqrt(D))]
    units = nq * B * Hq // Wq
    shared = stages * (1 + Wq) * 8192 + 16 * stages + 1024
    return entry, (min(units, sms) if persistent else units, 1, 1), 128 * (Wq + 1), shared, args


class Problem:
    """qkv, dy, y, lse, delta on the GPU (y and lse by the product's forward, delta by its delta kernel), dqkv and ds
    to write"""
    def __init__(self, modules, B, T, Hq, Hkv, seed=0):
        self.B, self.T, self.Hq, self.Hkv = B, T, Hq, Hkv
        self.qkv_host, self.dy_host = random_qkv(B, T, Hq, Hkv, seed), random_dy(B, T, Hq, seed + 1)
        self.qkv, self.dy = nc.to_gpu(self.qkv_host, np.uint16), nc.to_gpu(self.dy_host, np.uint16)
        self.y, self.lse = nc.DeviceArray((B * T, Hq * D), np.uint16), nc.DeviceArray((B, Hq, T))
        self.delta = nc.DeviceArray((B, Hq, T))
        self.dqkv = nc.DeviceArray((B * T, (Hq + 2 * Hkv) * D), np.uint16)
        self.ds = nc.DeviceArray((nc.attention_ds_size(B, T, Hq),), np.uint16)
        base.forward(modules, base.PRODUCT, self.y, self.lse, self.qkv, B, T, Hq, Hkv)
        lanes = D * 2 // 16
        base.launch(modules["product"], "attention_backward_delta_bf16_kernel", (-(-B * T * Hq * lanes // 256), 1, 1),
                    256, 0, nc.ptr_arg(self.delta), nc.ptr_arg(self.dy), nc.ptr_arg(self.y), nc.int_arg(B),
                    nc.int_arg(T), nc.int_arg(Hq), nc.int_arg(D))

    def dkv(self, modules, name, prepared=None):
        """one launch of the product's dk/dv pass (name PRODUCT) or of a version"""
        B, T, Hq, Hkv = self.B, self.T, self.Hq, self.Hkv
        if name == PRODUCT:
            base.launch(modules["product"], PRODUCT, (Hkv, B, -(-T // 64)), 128, 0, nc.ptr_arg(self.dqkv),
                        nc.ptr_arg(self.ds), nc.ptr_arg(self.qkv), nc.ptr_arg(self.dy), nc.ptr_arg(self.lse),
                        nc.ptr_arg(self.delta), nc.int_arg(T), nc.int_arg(Hq), nc.int_arg(Hkv),
                        nc.float_arg(1 / math.sqrt(D)))
            return
        entry, grid, threads, shared, args = prepared or self.arguments(name)
        base.launch(modules["variant"], entry, grid, threads, shared, *args)

    def arguments(self, name):
        return arguments(nc.cu, name, self.dqkv.ptr, self.ds.ptr, self.qkv.ptr, self.dy.ptr, self.lse.ptr,
                         self.delta.ptr, self.B, self.T, self.Hq, self.Hkv, nc.gpu.sms)

    def dq(self, modules, name=DQ_PRODUCT, prepared=None):
        """one launch of the product's dq pass (name DQ_PRODUCT) or of a dq version, on ds"""
        B, T, Hq, Hkv = self.B, self.T, self.Hq, self.Hkv
        if name == DQ_PRODUCT:
            base.launch(modules["product"], DQ_PRODUCT, (Hq, B, -(-T // 64)), 128, 0, nc.ptr_arg(self.dqkv),
                        nc.ptr_arg(self.qkv), nc.ptr_arg(self.ds), nc.int_arg(T), nc.int_arg(Hq), nc.int_arg(Hkv),
                        nc.float_arg(1 / math.sqrt(D)))
            return
        entry, grid, threads, shared, args = prepared or self.dq_arguments(name)
        base.launch(modules["variant"], entry, grid, threads, shared, *args)

    def dq_arguments(self, name):
        return dq_arguments(nc.cu, name, self.dqkv.ptr, self.qkv.ptr, self.ds.ptr, self.B, self.T, self.Hq, self.Hkv,
                            nc.gpu.sms)


def check_versions(modules):
    """-> how many (the product's pass too) are not OK at CHECKS; prints each one's errors"""
    bad = 0
    for B, T, Hq, Hkv in CHECKS:
        pb = Problem(modules, B, T, Hq, Hkv)
        dq_ref, dk_ref, dv_ref, _ = reference(pb.qkv_host, pb.dy_host, B - 1, T, Hq, Hkv)
        for name in [PRODUCT, *VERSIONS]:
            pb.dqkv.fill_bits(0xFFFF)                              # NaN: what a kernel does not write shows
            pb.ds.fill_bits(0xFFFF)
            pb.dkv(modules, name)
            finish(name)
            pb.dq(modules)
            nc.gpu.sync()
            out = from_bf16(pb.dqkv.download()).reshape(B, T, -1)[B - 1].astype(np.float64)
            written = np.isfinite(out).all()
            e = [relative_error(out[:, a * D:(a + n) * D], ref) for a, n, ref in
                 ((0, Hq, dq_ref), (Hq, Hkv, dk_ref), (Hq + Hkv, Hkv, dv_ref))]
            ok = written and max(e) <= DKV_BOUND
            bad += not ok
            print(f"{name:<38} B {B:>2} T {T} Hq {Hq} Hkv {Hkv}: dq {e[0]:9.2e}  dk {e[1]:9.2e}  dv {e[2]:9.2e}  "
                  f"{'all written' if written else 'NOT ALL WRITTEN'}  {'OK' if ok else 'NOT OK'}", flush=True)
        for name in DQ_VERSIONS:                                   # on the product's ds
            pb.dqkv.fill_bits(0xFFFF)
            pb.dkv(modules, PRODUCT)
            pb.dq(modules, name)
            finish(name)
            out = from_bf16(pb.dqkv.download()).reshape(B, T, -1)[B - 1].astype(np.float64)
            written = np.isfinite(out[:, :Hq * D]).all()
            e = relative_error(out[:, :Hq * D], dq_ref)
            ok = written and e <= DKV_BOUND
            bad += not ok
            print(f"{name:<38} B {B:>2} T {T} Hq {Hq} Hkv {Hkv}: dq {e:9.2e}  "
                  f"{'all written' if written else 'NOT ALL WRITTEN'}  {'OK' if ok else 'NOT OK'}", flush=True)
    return bad


def time_versions(modules):
    _, T, Hq, Hkv = CHECKS[0]
    print(f"{'us a call':<38} " + " ".join(f"{'B %d' % B:>16}" for B in BATCHES))
    for product, versions, dq in ((PRODUCT, VERSIONS, False), (DQ_PRODUCT, DQ_VERSIONS, True)):
        names = [product, *versions]
        table = {name: [] for name in names}
        for B in BATCHES:
            pb = Problem(modules, B, T, Hq, Hkv, seed=B)
            pb.dkv(modules, PRODUCT)                               # (ds for the dq pass)
            launch, prepare = (pb.dq, pb.dq_arguments) if dq else (pb.dkv, pb.arguments)
            for name in names:
                prepared = None if name == product else prepare(name)

                def run(name=name, prepared=prepared, launch=launch):
                    for _ in range(LAUNCHES):
                        launch(modules, name, prepared)
                table[name].append(base.timed(run, REPS) / LAUNCHES)
        for name in names:
            ratios = [t / p for t, p in zip(table[name], table[product])]
            print(f"{name:<38} " + " ".join(f"{t:8.1f} ({r:4.2f}x)" for t, r in zip(table[name], ratios)),
                  flush=True)
    print(f"(median of {REPS} runs of {LAUNCHES} launches; x: of the product's time, its dk/dv or dq pass)")


def main():
    gpu = base.start_gpu()
    cu, check = nc.cu, nc.check
    if gpu.arch != "90":
        sys.exit(f"wgmma and TMA need sm_90a (an H100 or H200); this is {gpu.name}, sm_{gpu.arch}")
    _, nvrtc = nc.import_cuda()
    print(f"{gpu.name} ({gpu.sms} SMs), NVRTC {'.'.join(map(str, nvrtc.nvrtcVersion()[1:]))}")
    modules = {}
    for key, file, arch in (("variant", os.path.join(HERE, "attention_backward_tma.cu"), "90a"),
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
