"""The TMA dk/dv pass at one shape on the GPU against float64 (python dev/gpu/dkv_tma_shapes.py B T Hq Hkv): check
stopped at B 2 T 150 Hq 3 Hkv 1 (CUDA_ERROR_ILLEGAL_INSTRUCTION) while the big model's T 512 steps ran: which shapes
fault (run each in its own process: a fault ends the context), e.g. T 150, 152, 128, 192, 512, 160, Hq 3 and 12"""
import os
import sys

import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import nanoeuler as ne                                                      # noqa: E402
import nanoeuler_cuda as nc                                                 # noqa: E402
B, T, Hq, Hkv = map(int, sys.argv[1:5]); D = 64
nc.init_gpu("bf16")
rng = np.random.default_rng(0)
N, QKV = B * T, (Hq + 2 * Hkv) * D
normal = lambda *shape: nc.bf16_round(rng.normal(size=shape).astype(np.float32))
qkv, dy = normal(N, QKV), normal(N, Hq * D)
qkv_g, dy_g = nc.activation(qkv, True), nc.activation(dy, True)
q = qkv[:, :Hq * D].astype(np.float64).reshape(B, T, Hq, D)
k = qkv[:, Hq * D:(Hq + Hkv) * D].astype(np.float64).reshape(B, T, Hkv, D)
v = qkv[:, (Hq + Hkv) * D:].astype(np.float64).reshape(B, T, Hkv, D)
ref, cache = ne.attention_forward(q, k, v)
dq, dk, dv = ne.attention_backward(dy.astype(np.float64).reshape(B, T, Hq, D), cache)
y, lse = nc.poisoned((N, Hq * D), True), nc.poisoned((B, Hq, T))
nc.attention_forward(y, lse, qkv_g, B, T, Hq, Hkv, D, tma=False)
for kernel in (False, True):
    dqkv, ds = nc.poisoned((N, QKV), True), nc.poisoned((nc.attention_ds_size(B, T, Hq),), True)
    delta = nc.DeviceArray((B, Hq, T))
    nc.attention_backward(dqkv, dy_g, qkv_g, y, lse, delta, ds, B, T, Hq, Hkv, D, tma=kernel)
    got = nc.values(dqkv)
    errors = [nc.rel_diff(got[:, a * D:b * D], ref.reshape(N, -1))
              for a, b, ref in ((0, Hq, dq), (Hq, Hq + Hkv, dk), (Hq + Hkv, Hq + 2 * Hkv, dv))]
    print(f"B {B} T {T} Hq {Hq} Hkv {Hkv} {'TMA' if kernel else 'mma.sync'}: dq dk dv "
          + " ".join(f"{e:.2e}" for e in errors), flush=True)
