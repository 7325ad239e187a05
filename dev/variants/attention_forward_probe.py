"""The bf16 attention forward at D = 64 built several ways, timed alone on one GPU (CuPy, not
NanoEuler's plumbing, so that a variant compiles in seconds). Each variant is flash_attn.cu (or
SOURCE) up to its entry points, with -D switches and the entry point at the bottom: FWD_MT m-tiles
a warp, FWD_KEYS keys a step, FWD_BLOCKS blocks an SM in its launch bounds. For each: median GPU
time of a launch at the big model's shape (T = 512, 12 query and 4 kv heads), B = 64 and 16, on
random N(0, 1) bf16 qkv; y and lse against float64 for batch row 0; bits against the first variant.
    SOURCE=flash_attn_variants.cu VARIANTS=";-DFWD_LAZY=8" python dev/variants/attention_forward_probe.py [--ncu]
(--ncu: one launch each, for ncu). The switches of dev/variants/attention_forward_rescale_exp_max.diff
(FWD_SKIP, FWD_LAZY, FWD_POLY, FWD_TREE, FWD_QS; none: the kept kernel) are in a copy of flash_attn.cu
with that diff applied (patch -o flash_attn_variants.cu flash_attn.cu < the diff), given as SOURCE."""
import os
import sys

import cupy as cp
import numpy as np

SOURCE = os.environ.get("SOURCE", "flash_attn.cu")
T, Hq, Hkv, D = 512, 12, 4, 64
ENTRY = r"""
#ifndef FWD_MT
#define FWD_MT 2
#endif
#ifndef FWD_KEYS
#define FWD_KEYS 32
#endif
#ifndef FWD_BLOCKS
#define FWD_BLOCKS 3
#endif
extern "C" __global__ void __launch_bounds__(MMA_THREADS, FWD_BLOCKS) attention_forward_bf16_kernel_64(
    unsigned short* y16, float* lse, const unsigned short* qkv16, int T, int Hq, int Hkv, float scale) {
    attention_forward_bf16<64, FWD_MT, FWD_KEYS>(y16, lse, qkv16, T, Hq, Hkv, scale);
}
"""
# VARIANTS="a;b": variants separated by ';', each its -D switches separated by ',' (and @FILE: built from
# FILE instead of SOURCE); an empty one is SOURCE as it stands (the default: only that)
VARIANTS = [[d for d in v.split(",") if d] for v in os.environ.get("VARIANTS", "").split(";")]


def bf16_bits(x):
    b = np.asarray(x, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(u):
    return (np.asarray(u, np.uint32) << 16).view(np.float32)


def reference(qkv, b):
    """y (T, Hq*D) and lse (Hq, T) of row b in float64"""
    x = from_bf16(qkv[b]).astype(np.float64)
    y, lse = np.zeros((T, Hq * D)), np.zeros((Hq, T))
    for h in range(Hq):
        kv = h // (Hq // Hkv)
        q, k, v = x[:, h * D:(h + 1) * D], x[:, (Hq + kv) * D:(Hq + kv + 1) * D], x[:, (Hq + Hkv + kv) * D:][:, :D]
        s = q @ k.T / np.sqrt(D)
        s[np.triu_indices(T, 1)] = -np.inf
        m = s.max(1, keepdims=True)
        p = np.exp(s - m)
        lse[h] = (m + np.log(p.sum(1, keepdims=True)))[:, 0]
        y[:, h * D:(h + 1) * D] = p @ v / p.sum(1, keepdims=True)
    return y, lse


def main():
    ncu = "--ncu" in sys.argv
    src = open(SOURCE).read()
    src = src[:src.index("// entry points")] + ENTRY
    rng = np.random.default_rng(0)
    data = {B: bf16_bits(rng.standard_normal((B, T, (Hq + 2 * Hkv) * D), np.float32)) for B in (64, 16)}
    ref = reference(data[16], 0)
    first = {}
    for variant in VARIANTS:
        defines = [d for d in variant if not d.startswith("@")]
        files = [d[1:] for d in variant if d.startswith("@")]          # @FILE: that source instead of SOURCE
        name = " ".join(variant) or "base"
        code = src
        if files:
            code = open(files[0]).read()
            code = code[:code.index("// entry points")] + ENTRY
        mod = cp.RawModule(code=code, options=("-std=c++17", "--use_fast_math", "-lineinfo", *defines))
        f = mod.get_function("attention_forward_bf16_kernel_64")
        mt = int(next((d.split("=")[1] for d in defines if d.startswith("-DFWD_MT=")), 2))
        row = [f"{name:<40} regs {f.num_regs:3d} local {f.local_size_bytes:3d}"]
        for B in (64, 16):
            qkv = cp.asarray(data[B])
            y, lse = cp.full((B, T, Hq * D), 0xFFFF, cp.uint16), cp.full((B, Hq, T), np.nan, cp.float32)
            launch = lambda: f((Hq, B, (T + 64 * mt - 1) // (64 * mt)), (128,),
                               (y, lse, qkv, np.int32(T), np.int32(Hq), np.int32(Hkv), np.float32(1 / np.sqrt(D))))
            launch()
            cp.cuda.runtime.deviceSynchronize()
            if ncu:
                continue
            yh, lh = cp.asnumpy(y), cp.asnumpy(lse)
            if B == 16:
                err = np.linalg.norm(from_bf16(yh[0]) - ref[0]) / np.linalg.norm(ref[0])
                lerr = np.abs(lh[0] - ref[1]).max()
                row.append(f"y rel err {err:.2e} lse max err {lerr:.1e}")
            if B not in first:
                first[B] = (yh, lh)
            else:
                row.append(f"B={B} differs from first in {np.sum(yh != first[B][0])} y, {np.sum(lh != first[B][1])} lse")
            times = []
            for _ in range(7):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record()
                for _ in range(20):
                    launch()
                b.record()
                b.synchronize()
                times.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / 20)
            row.insert(1, f"B={B} {np.median(times):7.1f} us")
        print(" | ".join(row), flush=True)


main()
