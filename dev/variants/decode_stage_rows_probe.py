"""What a second (third, fourth) row costs each kind of a decoding pass's launches, in the pass's
setting (issue 35): for each stage of the big model's layer 0 (random bf16 weights, rows from
position 16), a CUDA graph of 83 copies of that one launch with programmatic dependent launch,
replayed, at R = 1, 2, 4 rows; GPU time a launch. Then the whole pass over R rows, 1 head, and
R heads. Run from the root of a tree: python dev/variants/decode_stage_rows_probe.py"""
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nanoeuler_cuda as nc     # noqa: E402
from decode_stage_probe import LAUNCHES, layer0, per_launch_us   # noqa: E402


def main():
    cfg, dec, w, p, (C, F, HD, QKV) = layer0()
    mv, records = nc.decode_matvec, (cfg.Hq, cfg.Hkv, nc.ceil_div(cfg.T, nc.DECODE_CHUNK))
    stages = {
        "qkv (rmsnorm)": lambda R: mv(dec.qkv, dec.x, w["layers.0.wqkv"], p["layers.0.attn_norm"], R, C, QKV,
                                      "rmsnorm", pdl=True),
        "qkv, plain input": lambda R: mv(dec.qkv, dec.x, w["layers.0.wqkv"], None, R, C, QKV, pdl=True),
        "attention (records)": lambda R: dec.attend(0, dec.y, dec.qkv, R, pdl=True, combine=False),
        "wo (combine, +=)": lambda R: mv(dec.x, dec.split[0], w["layers.0.wo"], dec.pos, R, HD, C, "attention",
                                         accumulate=True, pdl=True, records=records),
        "wo (plain, +=)": lambda R: mv(dec.x, dec.y, w["layers.0.wo"], None, R, HD, C, accumulate=True, pdl=True),
        "gate/up (rmsnorm)": lambda R: mv(dec.gu, dec.x, w["layers.0.w_gate_up"], p["layers.0.mlp_norm"], R, C,
                                          2 * F, "rmsnorm", pdl=True),
        "down (swiglu, +=)": lambda R: mv(dec.x, dec.gu, w["layers.0.w_down"], None, R, F, C, "swiglu",
                                          accumulate=True, pdl=True),
        "heads, 1 (rmsnorm)": lambda R: mv(dec.logits, dec.x, dec.heads, p["final_norm"], R, C, cfg.V, "rmsnorm",
                                           splits=dec.head_splits, pdl=True),
    }
    rows = (1, 2, 4)
    print(f"{nc.gpu.name}: {LAUNCHES} copies of one launch in a graph (PDL); GPU time a launch, R = 1 / 2 / 4")
    for name, launch in stages.items():
        us = [per_launch_us(lambda: launch(R)) for R in rows]
        print(f"  {name:<22} " + " / ".join(f"{u:5.2f}" for u in us) + f" us   (+{us[1] - us[0]:.2f}, +{us[2] - us[0]:.2f})")
    for R in rows:
        dec.set_feed([0] * R, 16)
        a = nc.replay_time(dec, 40, R, 1)
        dec.set_feed([0] * R, 16)
        b = nc.replay_time(dec, 40, R, R)
        print(f"  the pass over {R} row{'s' * (R > 1)}: 1 head {a:.1f} us, {R} head{'s' * (R > 1)} {b:.1f} us")


if __name__ == "__main__":
    main()
