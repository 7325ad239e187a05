"""The forward's products through cuBLASLt (issue 36): for each product of big's step at B = 64 and
16 (N = B * 512 rows, bf16 in and out, fp32 sums, out = x @ w.T), cublasGemmEx as Cublas.gemm calls
it, against cuBLASLt's first 8 heuristic algorithms, each with a separate C added in the epilogue
(out = c + x @ w.T, as Cublas.gemm's add: the residual stream) and with none (beta 0, C = out).
Median of 5 x 20 calls between CUDA events, on random bf16. Needs Cublas.gemm's add and lt_plan,
which only dev/variants/residual_add_in_product_epilogue.diff has (landed and reverted 2026-12-05: dev/LOG.md).
Run from the root of a tree with that diff applied:
    python dev/variants/lt_forward_probe.py"""
import ctypes
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402

import nanoeuler_cuda as nc  # noqa: E402
from matmul_layout_probe import Device, random_bf16, time_us  # noqa: E402


def heuristics(cb, plan, count=8):
    desc, lb, la, lo, _ = plan
    pref, size = ctypes.c_void_p(), ctypes.c_uint64(cb.workspace_bytes)
    cb.check(cb.lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
    cb.check(cb.lt.cublasLtMatmulPreferenceSetAttribute(pref, nc.CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                        ctypes.byref(size), 8), "pref size")
    found, n = (nc.LtHeuristic * count)(), ctypes.c_int(0)
    cb.check(cb.lt.cublasLtMatmulAlgoGetHeuristic(cb.lt_handle, desc, lb, la, lo, lo, pref, count, found,
                                                  ctypes.byref(n)), "heuristic")
    return [found[i] for i in range(n.value)]


def lt_call(cb, plan, algo, out, x, w, c, beta):
    desc, lb, la, lo, _ = plan
    cb.check(cb.lt.cublasLtMatmul(cb.lt_handle, desc, ctypes.addressof(cb.one), w.ptr, lb, x.ptr, la,
                                  ctypes.addressof(beta), c.ptr, lo, out.ptr, lo, ctypes.addressof(algo.algo),
                                  cb.workspace.ptr, cb.workspace_bytes, cb.stream), "cublasLtMatmul")


def main():
    nc.gpu = Device()
    cb = nc.gpu.cublas = nc.Cublas(nc.gpu.stream)
    rng = np.random.default_rng(0)
    C, F, V, K = 768, 2048, 4096, 4
    QKV = (12 + 2 * 4) * 64
    products = [("wqkv", QKV, C), ("wo", C, C), ("w_gate_up", 2 * F, C), ("w_down", C, F), ("heads", K * V, C)]
    for B in (64, 16):
        N = B * 512
        for name, out_f, in_f in products:
            x, w, c = random_bf16(rng, (N, in_f)), random_bf16(rng, (out_f, in_f)), random_bf16(rng, (N, out_f))
            y = nc.DeviceArray((N, out_f), np.uint16)
            flop = 2 * N * out_f * in_f
            gemm = time_us(lambda: cb.gemm(y, x, w, N, out_f, in_f, trans_b=True))
            add = time_us(lambda: cb.gemm(y, x, w, N, out_f, in_f, trans_b=True, add=c))
            key = (N, out_f, in_f, False, True, nc.CUDA_R_16BF, nc.CUDA_R_16BF, nc.CUDA_R_16BF, nc.CUBLAS_COMPUTE_32F)
            plan = cb.lt_plans[key]
            line = [f"{name:<10} B={B:<3} GemmEx {gemm:7.1f} us {flop / gemm / 1e6:3.0f} | Lt + add (first) "
                    f"{add:7.1f} us {flop / add / 1e6:3.0f} | Lt's algorithms, + add / beta 0:"]
            for h in heuristics(cb, plan):
                t_add = time_us(lambda: lt_call(cb, plan, h, y, x, w, c, cb.one))
                t_0 = time_us(lambda: lt_call(cb, plan, h, y, x, w, y, cb.zero))
                line.append(f"{t_add:6.1f}/{t_0:6.1f}")
            print(" ".join(line), flush=True)
    print("(microseconds a call, then TFLOP/s)")


main()
