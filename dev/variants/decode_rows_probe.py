"""Which decode kernel costs more when a pass has more rows? Each of a step's kinds of launch,
50 times back to back in one CUDA graph (with PDL, as in a step), replayed, for R = 1, 2, 4:
GPU time per launch. Random weights of big, bf16, *pos = 11. Run from the repository root:
python dev/variants/decode_rows_probe.py"""
import os
import sys

sys.path.insert(0, os.getcwd())
import numpy as np  # noqa: E402

import nanoeuler as ne  # noqa: E402
import nanoeuler_cuda as nc  # noqa: E402

cfg = nc.PRESETS[os.environ.get("PRESET", "big")]
nc.init_gpu("bf16")
dec = nc.GPUDecoder(cfg, ne.init_params(cfg), "bf16")
dec.wait(dec.prefill(list(range(11)), 1))
w, p = dec.weights, dec.params
C, F, QKV = cfg.C, cfg.F, (cfg.Hq + 2 * cfg.Hkv) * cfg.D
kinds = {
    "qkv (rmsnorm)": lambda R: nc.decode_matvec(dec.qkv, dec.x, w["layers.0.wqkv"], p["layers.0.attn_norm"], R, C, QKV,
                                                "rmsnorm", pdl=dec.pdl),
    "wo (plain, +=)": lambda R: nc.decode_matvec(dec.x, dec.y, w["layers.0.wo"], None, R, C, C, accumulate=True,
                                                 pdl=dec.pdl),
    "gate_up (rmsnorm)": lambda R: nc.decode_matvec(dec.gu, dec.x, w["layers.0.w_gate_up"], p["layers.0.mlp_norm"], R,
                                                    C, 2 * F, "rmsnorm", pdl=dec.pdl),
    "down (swiglu, +=)": lambda R: nc.decode_matvec(dec.x, dec.gu, w["layers.0.w_down"], None, R, F, C, "swiglu",
                                                    accumulate=True, pdl=dec.pdl),
    "heads (1 head)": lambda R: nc.decode_matvec(dec.logits, dec.x, dec.heads.view(0, (cfg.V, C)), p["final_norm"], R,
                                                 C, cfg.V, "rmsnorm", splits=dec.head_splits, pdl=dec.pdl),
    "attention": lambda R: dec.attend(0, dec.y, dec.qkv, R, pdl=dec.pdl),
}
N, replays = int(os.environ.get("N", 50)), int(os.environ.get("REPLAYS", 20))
for name, launch in kinds.items():
    times = []
    for R in (1, 2, 4):
        graph = nc.capture_graph(lambda: [launch(R) for _ in range(N)], name)
        a, b = (nc.check(nc.cu.cuEventCreate(0), "cuEventCreate") for _ in range(2))
        nc.check(nc.cu.cuGraphLaunch(graph, nc.gpu.stream), "cuGraphLaunch")
        nc.check(nc.cu.cuEventRecord(a, nc.gpu.stream), "cuEventRecord")
        for _ in range(replays):
            nc.check(nc.cu.cuGraphLaunch(graph, nc.gpu.stream), "cuGraphLaunch")
        nc.check(nc.cu.cuEventRecord(b, nc.gpu.stream), "cuEventRecord")
        nc.gpu.sync()
        times.append(nc.check(nc.cu.cuEventElapsedTime(a, b), "cuEventElapsedTime") * 1e3 / (N * replays))
    print(f"{name:<20} " + "  ".join(f"R={R}: {t:6.2f} us" for R, t in zip((1, 2, 4), times)), flush=True)
