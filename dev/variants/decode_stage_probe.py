"""What each kind of a decoding pass's launches costs in the pass's setting (issue 35): for each
stage of the big model's layer 0 (random bf16 weights, one row at position 16), a CUDA graph of 83
copies of that one launch with programmatic dependent launch, replayed; GPU time a launch. Beside
them, the same product with its input's treatment changed (the norm or the residual add left
out), which says what that part of a stage's chain costs. Run from the root of a tree:
python dev/variants/decode_stage_probe.py"""
import os
import sys

sys.path.insert(0, os.getcwd())
import nanoeuler as ne          # noqa: E402
import nanoeuler_cuda as nc     # noqa: E402

LAUNCHES, REPLAYS = 83, 100


def per_launch_us(launch, replays=REPLAYS):
    """microseconds of GPU time a launch: LAUNCHES calls of launch() captured in one graph, replayed
    (pdl_floor_probe.py times its chains with this too)"""
    graph = nc.capture_graph(lambda: [launch() for _ in range(LAUNCHES)], "a probe")
    start, end = (nc.check(nc.cu.cuEventCreate(0), "cuEventCreate") for _ in range(2))
    nc.check(nc.cu.cuGraphLaunch(graph, nc.gpu.stream), "cuGraphLaunch")          # warm-up
    nc.check(nc.cu.cuEventRecord(start, nc.gpu.stream), "cuEventRecord")
    for _ in range(replays):
        nc.check(nc.cu.cuGraphLaunch(graph, nc.gpu.stream), "cuGraphLaunch")
    nc.check(nc.cu.cuEventRecord(end, nc.gpu.stream), "cuEventRecord")
    nc.gpu.sync()
    us = nc.check(nc.cu.cuEventElapsedTime(start, end), "cuEventElapsedTime") * 1e3 / replays / LAUNCHES
    for e in (start, end):
        nc.cu.cuEventDestroy(e)
    return us


def layer0():
    """-> cfg, a bf16 decoder of the big model (random weights) after a 16-token prefill, its weights and params,
    and (C, F, HD, QKV): what each probe's stages of layer 0 are built from (decode_stage_rows_probe.py too)"""
    cfg = ne.PRESETS["big"]
    dec = nc.GPUDecoder(cfg, ne.init_params(cfg), "bf16")
    dec.wait(dec.prefill(list(range(16)), 1))
    return cfg, dec, dec.weights, dec.params, (cfg.C, cfg.F, cfg.Hq * cfg.D, (cfg.Hq + 2 * cfg.Hkv) * cfg.D)


def main():
    cfg, dec, w, p, (C, F, HD, QKV) = layer0()
    mv = nc.decode_matvec
    stages = {
        "qkv (rmsnorm)": lambda: mv(dec.qkv, dec.x, w["layers.0.wqkv"], p["layers.0.attn_norm"], 1, C, QKV,
                                    "rmsnorm", pdl=True),
        "qkv, plain input": lambda: mv(dec.qkv, dec.x, w["layers.0.wqkv"], None, 1, C, QKV, pdl=True),
        "attention (split)": lambda: dec.attend(0, dec.y, dec.qkv, 1, pdl=True),
        "wo (plain, +=)": lambda: mv(dec.x, dec.y, w["layers.0.wo"], None, 1, HD, C, accumulate=True, pdl=True),
        "wo, no +=": lambda: mv(dec.x, dec.y, w["layers.0.wo"], None, 1, HD, C, pdl=True),
        "gate/up (rmsnorm)": lambda: mv(dec.gu, dec.x, w["layers.0.w_gate_up"], p["layers.0.mlp_norm"], 1, C,
                                        2 * F, "rmsnorm", pdl=True),
        "gate/up, plain input": lambda: mv(dec.gu, dec.x, w["layers.0.w_gate_up"], None, 1, C, 2 * F, pdl=True),
        "down (swiglu, +=)": lambda: mv(dec.x, dec.gu, w["layers.0.w_down"], None, 1, F, C, "swiglu",
                                        accumulate=True, pdl=True),
        "heads, 1 (rmsnorm)": lambda: mv(dec.logits, dec.x, dec.heads, p["final_norm"], 1, C, cfg.V, "rmsnorm",
                                         splits=dec.head_splits, pdl=True),
    }
    print(f"{nc.gpu.name}: {LAUNCHES} copies of one launch in a graph (PDL), {REPLAYS} replays; GPU time a launch")
    for name, launch in stages.items():
        print(f"  {name:<24} {per_launch_us(launch):6.2f} us")
    us = [nc.replay_time(dec, 100) for _ in range(2)]
    print(f"  the one-row pass (83 launches): {us[0]:.1f} / {us[1]:.1f} us, {us[0] / 83:.2f} us a launch")


if __name__ == "__main__":
    main()
