"""GPU time of a one-row decoding pass of the big model (random bf16 weights) replayed from its
graph, with decode_pass and with the launches: python dev/variants/decode_pass_probe.py from the
root of a tree with dev/variants/decode_pass.diff applied (its kernels.cu may be a timing
variant whose logits are wrong)"""
import os
import sys

sys.path.insert(0, os.getcwd())
import nanoeuler as ne          # noqa: E402
import nanoeuler_cuda as nc     # noqa: E402

cfg = ne.PRESETS["big"]
flat = ne.init_params(cfg)
for fused in (True, False):
    dec = nc.GPUDecoder(cfg, flat, "bf16", fused=fused)
    dec.wait(dec.prefill(list(range(16)), 1))
    us = [nc.replay_time(dec, 100) for _ in range(2)]
    print(f"{'decode_pass' if dec.fused else 'launches'}: a one-row pass {us[0]:.1f} / {us[1]:.1f} us of GPU time")
