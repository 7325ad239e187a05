"""Does cuBLAS (cublasGemmEx, as nanoeuler_cuda.Cublas calls it) run the forward's products faster
with the weights stored transposed? For each product of big's step, at B = 64 and 16 (N = B * 512
rows), bf16 in and out, fp32 sums: the forward as it is, out = x @ w.T ("NT", w (out, in)), against
out = x @ wt ("NN", wt (in, out) a transposed copy); and the backward's two products of the same
weight for reference: dx = dout @ w ("NN") and dw += dout.T @ x ("TN", fp32 out). Median of 5 x 20
calls between CUDA events, on random bf16. Run from the repository root:
    python dev/variants/matmul_layout_probe.py"""
import contextlib
import os
import sys

sys.path.insert(0, os.getcwd())
import numpy as np  # noqa: E402

import nanoeuler_cuda as nc  # noqa: E402


class Device:                                   # what Cublas needs of nanoeuler_cuda.gpu, without compiling kernels
    precision = "bf16"

    def __init__(self):
        nc.count_gpus()
        cu = nc.cu
        dev = nc.check(cu.cuDeviceGet(0), "cuDeviceGet")
        nc.check(cu.cuCtxSetCurrent(nc.check(cu.cuDevicePrimaryCtxRetain(dev), "ctx")), "cuCtxSetCurrent")
        self.stream = nc.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")

    def timed(self, name):
        return contextlib.nullcontext()

    def sync(self, what="the GPU's work"):
        nc.check(nc.cu.cuStreamSynchronize(self.stream), what)


def random_bf16(rng, shape):
    a = nc.DeviceArray(shape, np.uint16)
    bits = rng.integers(0x3E00, 0x3F80, shape, dtype=np.uint16)        # +-[0.125, 1): never zero
    a.upload(bits | (rng.integers(0, 2, shape, dtype=np.uint16) << 15))
    return a


def time_us(f, reps=20, rounds=5):
    cu, times = nc.cu, []
    for _ in range(rounds + 1):
        a, b = (nc.check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2))
        nc.check(cu.cuEventRecord(a, nc.gpu.stream), "cuEventRecord")
        for _ in range(reps):
            f()
        nc.check(cu.cuEventRecord(b, nc.gpu.stream), "cuEventRecord")
        nc.check(cu.cuStreamSynchronize(nc.gpu.stream), "sync")
        times.append(nc.check(cu.cuEventElapsedTime(a, b), "elapsed") * 1e3 / reps)
    return float(np.median(times[1:]))                       # the first round is the warm-up


def main():
    nc.gpu = Device()
    cb = nc.gpu.cublas = nc.Cublas(nc.gpu.stream)
    rng = np.random.default_rng(0)
    C, F, V, K = 768, 2048, 4096, 4
    QKV = (12 + 2 * 4) * 64
    products = [("wqkv", QKV, C), ("wo", C, C), ("w_gate_up", 2 * F, C), ("w_down", C, F), ("heads", K * V, C)]
    print(f"{'product':<10} {'B':>3} {'fwd NT (now)':>14} {'fwd NN (w.T kept)':>18} {'dx NN':>14} {'dw TN':>14}")
    for B in (64, 16):
        N = B * 512
        for name, out_f, in_f in products:
            x, dout = random_bf16(rng, (N, in_f)), random_bf16(rng, (N, out_f))
            w, wt = random_bf16(rng, (out_f, in_f)), random_bf16(rng, (in_f, out_f))
            y, dx = nc.DeviceArray((N, out_f), np.uint16), nc.DeviceArray((N, in_f), np.uint16)
            dw = nc.DeviceArray((out_f, in_f), np.float32)
            flop = 2 * N * out_f * in_f
            t = [time_us(lambda: cb.gemm(y, x, w, N, out_f, in_f, trans_b=True)),
                 time_us(lambda: cb.gemm(y, x, wt, N, out_f, in_f)),
                 time_us(lambda: cb.gemm(dx, dout, w, N, in_f, out_f)),
                 time_us(lambda: cb.gemm(dw, dout, x, out_f, in_f, N, trans_a=True, accumulate=True))]
            print(f"{name:<10} {B:>3} " + " ".join(f"{u:7.1f} us {flop / u / 1e6:3.0f}" for u in t), flush=True)
    print("(each: microseconds a call, then TFLOP/s)")


if __name__ == "__main__":
    main()
