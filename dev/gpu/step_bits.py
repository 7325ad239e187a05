"""
Whole training steps of the big model in bf16 (issue 36), run three times from the same weights and batches: from
its CUDA graph, the same again, and kernel by kernel (--no-graph). Prints each run's losses and a digest of the
weights and moments after it, then whether all three are the same bits: the step has no atomics, so they must be.
Says which attention forward and dk/dv pass and which forward products ran (the TMA ones on an H100 or H200). From
the repository root:

    python dev/gpu/step_bits.py [--batch 16] [--steps 3]
"""

import argparse
import hashlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import nanoeuler as ne                                          # noqa: E402
import nanoeuler_cuda as nc                                     # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    nc.init_gpu("bf16")
    cfg = ne.PRESETS["big"]
    flat = ne.init_params(cfg)
    rng = np.random.default_rng(0)
    batches = [ne.split_rows(rng.integers(0, cfg.V, (a.batch, cfg.T + cfg.K)), cfg.T, cfg.K) for _ in range(a.steps)]
    seen = []
    for run, graph in (("graph", True), ("graph again", True), ("kernel by kernel", False)):
        args = argparse.Namespace(batch=a.batch, zero=False, clip=1.0, weight_decay=0.1, no_graph=not graph)
        engine = nc.GPUEngine(cfg, flat, None, None, args)
        losses = [engine.step(idx, targets, 1e-4, s + 1)[0] for s, (idx, targets) in enumerate(batches)]
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in engine.host_weights()))
        forward = "TMA" if nc.attention_tma(cfg.D, engine.model.qkv[0]) else "mma.sync"
        dkv = "TMA" if nc.attention_tma(cfg.D, engine.model.qkv[0], backward=True) else "mma.sync"
        m = engine.model
        products = "TMA" if nc.product_tma(m.gu[0], m.mlp_in[0], m.params["layers.0.w_gate_up"], 2 * cfg.F, cfg.C) \
            else "cuBLAS"
        dx = "TMA" if nc.product_tma(m.dgu, m.dx, m.params["layers.0.w_down"], cfg.F, cfg.C, backward=True) \
            else "cuBLAS"
        print(f"{run:<17} ({forward} forward, {dkv} dk/dv, {products} products, {dx} data gradients): "
              f"losses {' '.join(f'{x:.6f}' for x in losses)}, "
              f"weights and moments {digest.hexdigest()[:16]}", flush=True)
        seen.append((losses, digest.hexdigest()))
        engine.close()
        del engine
    same = all(s == seen[0] for s in seen)
    print("step bits: the same in all three runs" if same else "step bits: NOT THE SAME")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
