"""
Times variants of rmsnorm_backward_kernel and residual_rmsnorm_forward_kernel
(dev/variants/rmsnorm_variants.cu, appended to kernels.cu) against the kernels
before them (v0) and as they are now at the big model's batch-64 shape (N = 64 x 512 rows, C = 768, bf16),
after checking that each gives the same dx (bits) and dw (within 1e-4). Not part
of NanoEuler: python dev/variants/rmsnorm_variants.py on a GPU.
"""
import os
import shutil
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
import nanoeuler_cuda as nc                                    # noqa: E402

tmp = tempfile.mkdtemp()
with open(os.path.join(ROOT, "kernels.cu")) as f, open(os.path.join(HERE, "rmsnorm_variants.cu")) as g:
    open(os.path.join(tmp, "kernels.cu"), "w").write(f.read() + g.read())
shutil.copy(os.path.join(ROOT, "flash_attn.cu"), tmp)
nc.HERE = tmp
gpu = nc.init_gpu("bf16")
cu, check, P, I = nc.cu, nc.check, nc.ptr_arg, nc.int_arg
N, C, SMS = 64 * 512, 768, gpu.sms
rng = np.random.default_rng(0)


def bf16_bits(a):
    return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf(a):
    return nc.to_gpu(bf16_bits(a), np.uint16)


def timed(run, reps=30):
    """median us of run() over reps, CUDA events around each"""
    ev = [check(cu.cuEventCreate(0), "ev") for _ in range(2)]
    times = []
    for _ in range(3):
        run()
    for _ in range(reps):
        check(cu.cuEventRecord(ev[0], gpu.stream), "rec")
        run()
        check(cu.cuEventRecord(ev[1], gpu.stream), "rec")
        gpu.sync()
        times.append(check(cu.cuEventElapsedTime(ev[0], ev[1]), "el") * 1000)
    return float(np.median(times))


dout, x, dx0 = bf(rng.normal(size=(N, C))), bf(rng.normal(size=(N, C))), rng.normal(size=(N, C))
w = nc.to_gpu(rng.normal(1, 0.1, C).astype(np.float32))
rstd = nc.to_gpu(rng.uniform(0.5, 2, N).astype(np.float32))
dx, dw = nc.DeviceArray((N, C), np.uint16), nc.DeviceArray((C,))
partial = nc.DeviceArray((16 * SMS * C,))
dx_init = bf16_bits(dx0)


def backward(name, per_sm, accumulate=1, block=256):
    grid = min(N // (block // 32), per_sm * SMS)

    def run():
        gpu.launch(name, grid, block, P(dx), P(partial), P(dout), P(x), P(w), P(rstd), I(N), I(C), I(accumulate),
                   shared=4 * C * block // 32, bf16=True)
        gpu.launch("rmsnorm_backward_dw_kernel", nc.ceil_div(C, 32), 256, P(dw), P(partial), I(grid), I(C), bf16=True)
    return run


def result(run):
    dx.upload(dx_init)
    dw.zero()
    run()
    return dx.download(), dw.download()


print(f"{gpu.name}, N={N}, C={C}, bf16; bytes a backward call: dout, x, dx read and dx written")
ref_dx, ref_dw = result(backward("v0_rmsnorm_backward_kernel", 2))
moved = 4 * N * C * 2
VARIANTS = os.environ.get("VARIANTS", "v0_rmsnorm_backward_kernel rmsnorm_backward_kernel_768 v3_rmsnorm_backward_kernel:256 v5_rmsnorm_backward_kernel:256 "
                          "v5_rmsnorm_backward_kernel:128 v6_rmsnorm_backward_kernel:128").split()
for spec in VARIANTS:
    name, block = spec.split(":") if ":" in spec else (spec, 256)
    for per_sm in (1, 2, 3, 4, 6) if int(block) == 256 else (2, 3, 4, 6, 8):
        run = backward(name, per_sm, block=int(block))
        got_dx, got_dw = result(run)
        same = np.array_equal(got_dx, ref_dx) and np.allclose(got_dw, ref_dw, rtol=1e-4, atol=1e-2)
        us = timed(run)
        print(f"  {name:32s} {block} threads, {per_sm} blocks/SM  {us:7.1f} us  {moved / us / 1e6:5.2f} TB/s  "
              f"{'same' if same else 'DIFFERENT'}", flush=True)

a = bf(rng.normal(size=(N, C)))
xs, out, rs = nc.DeviceArray((N, C), np.uint16), nc.DeviceArray((N, C), np.uint16), nc.DeviceArray((N,))


def forward(name):
    def run():
        gpu.launch(name, N // 8, 256, P(xs), P(out), P(rs), P(x), P(a), P(w), I(N), I(C), bf16=True)
    return run


print("residual_rmsnorm_forward: x_in and a read, x and out written")
refs = None
for name in ["residual_rmsnorm_forward_kernel", "f1_residual_rmsnorm_forward_kernel",
             "f2_residual_rmsnorm_forward_kernel"]:
    run = forward(name)
    run()
    got = (xs.download(), out.download(), rs.download())
    refs = refs or got
    same = all(np.array_equal(g, r) for g, r in zip(got, refs))
    us = timed(run)
    print(f"  {name:36s} {us:7.1f} us  {moved / us / 1e6:5.2f} TB/s  {'same' if same else 'DIFFERENT'}", flush=True)
