"""
Issue 40's before and after on one GPU, the big model (bash dev/gpu/async_save.sh runs it;
alone: python dev/gpu/async_save_probe.py FOLDER [PRESET], which gets two checkpoints, deleted after).
Before: what a checkpoint held the training loop for (the weights and moments copied from
the GPU into pageable numpy arrays, then the pair written and pruned, the loop waiting).
After: what RunFolder.save (CheckpointWriter then) holds it for (copies into page-locked memory), the write's
own time, and the step time while the write runs beside the steps against the step time alone.
"""

import argparse
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, HERE)
import nanoeuler as ne  # noqa: E402
import nanoeuler_cuda as nc  # noqa: E402
import numpy as np  # noqa: E402

folder = sys.argv[1]
os.makedirs(folder, exist_ok=True)
nc.init_gpu("bf16")
cfg = nc.preset_config(sys.argv[2] if len(sys.argv) > 2 else "big")
n = ne.num_params(cfg)
engine = nc.GPUEngine(cfg, ne.init_params(cfg), None, None,
                      argparse.Namespace(batch=16, zero=False, clip=1.0, weight_decay=0.1, no_graph=False))
rng = np.random.default_rng(0)
batch = ne.split_rows(rng.integers(0, cfg.V, (16, cfg.T + cfg.K)), cfg.T, cfg.K)
tok, clock = ne.Tokenizer(), time.perf_counter
step = 0


def steps(k):
    """k steps -> their times (s); each step waits for the GPU (it reads the loss)"""
    global step
    times = []
    for _ in range(k):
        step += 1
        t0 = clock()
        engine.step(*batch, 1e-4, step)
        times.append(clock() - t0)
    return times


steps(10)                                                       # warm-up, the graph captured
alone = statistics.median(steps(100))
print(f"GPU {nc.gpu.name}; {sys.argv[2] if len(sys.argv) > 2 else 'big'}: {n:,} parameters, {3 * 4 * n / 1e9:.2f} GB of weights and moments; "
      f"a step alone {alone * 1e3:.2f} ms (median of 100)")

# before: pageable copies, then the pair written and pruned while the loop waits
state = {"step": step, "rng": rng.bit_generator.state}
t0 = clock()
flat, m, v = engine.host_params(), engine.model.m.download()[:n], engine.model.v.download()[:n]
t1 = clock()
ne.RunFolder(folder, cfg, tok).write_pair(step, flat, m, v, state)
ne.RunFolder(folder).prune()
t2 = clock()
print(f"before: a checkpoint held training {t2 - t0:.2f} s: copies from the GPU {t1 - t0:.3f} s (pageable), "
      f"the pair written {t2 - t1:.2f} s")
del flat, m, v

# after: RunFolder.save, the write beside the steps
saves = ne.RunFolder(folder, cfg, tok, clock)
for attempt in ("first (page-locked buffers made)", "second"):
    steps(5)
    saves.save(step, engine, {"step": step}, rng)
    beside = []
    while ne.RunFolder.thread and ne.RunFolder.thread.is_alive():    # the write in flight
        beside += steps(1)
    saves.finish()
    print(f"after, {attempt}: training held {saves.paused:.3f} s, the pair written in {saves.took:.2f} s beside "
          f"{len(beside)} steps of {statistics.median(beside) * 1e3 if beside else float('nan'):.2f} ms "
          f"(median; the slowest {max(beside, default=float('nan')) * 1e3:.1f} ms; alone {alone * 1e3:.2f} ms)")
shutil.rmtree(folder)
