"""GPU time of a decoding pass of the big model (random bf16 weights) over 1 and 2 rows, replayed
from its graph, and plain and speculative tokens/s: python dev/variants/decode_probe.py (from the
root of a tree)"""
import os
import sys

sys.path.insert(0, os.getcwd())
import nanoeuler as ne          # noqa: E402
import nanoeuler_cuda as nc     # noqa: E402

cfg, prompt = ne.PRESETS["big"], list(range(16))
dec = nc.GPUDecoder(cfg, ne.init_params(cfg), "bf16")
dec.wait(dec.prefill(prompt, 1))
one = [nc.replay_time(dec, 50) for _ in range(2)]
dec.wait(dec.prefill(prompt, 1))
two = nc.replay_time(dec, 50, 2, 2)
plain, dt, _ = nc.time_generate(dec, cfg, prompt, 500)
spec, dt_s, _ = nc.time_generate(dec, cfg, prompt, 500, True, 1)
print(f"a pass: 1 row {one[0]:.1f} / {one[1]:.1f} us, 2 rows 2 heads {two:.1f} us; plain {len(plain) / dt:,.0f} tok/s, "
      f"speculative 1 draft {len(spec) / dt_s:,.0f} tok/s, same as plain: {spec == plain}")
