"""How far could drafts take speculative decoding on a trained model, and what does a pass over
more rows cost? Run from the repository root: python dev/variants/draft_ranks.py MODEL [OUT.npz]

1. A pass over R = 1..8 rows (1 and K heads) replayed from its graph: GPU time (as bench's --profile).
2. Plain greedy decoding on the GPU (bf16) from BENCH_PROMPT's first 16 tokens to the end of the
   window, then nanoeuler.py's float32 forward over the whole sequence: for each position t the
   rank of the token greedy chose at t+1+k among head k's logits at t (rank 0: the draft is right).
3. From those ranks, the tokens a pass would give for draft trees: depth d holds head d's best
   w_d guesses; "full": every guess of depth d under every node of depth d-1; "chain": the extra
   guesses only beside the best one's chain (rows = 1 + sum of widths)."""
import itertools
import os
import sys

sys.path.insert(0, os.getcwd())
import numpy as np  # noqa: E402

import nanoeuler as ne  # noqa: E402
import nanoeuler_cuda as nc  # noqa: E402

path = sys.argv[1]
cfg, flat, tok = ne.load_model(path)
prompt = tok.encode(nc.BENCH_PROMPT)[:16]
cpu = os.environ.get("CPU")                  # CPU=1: nanoeuler.py's greedy, no timing (to try the script)
if not cpu:
    nc.init_gpu("bf16")
    dec = nc.GPUDecoder(cfg, flat, "bf16")
for heads in sorted({1, cfg.K}) if not cpu else []:
    times = []
    for R in range(1, nc.DECODE_MAX_ROWS + 1):
        dec.wait(dec.prefill(prompt, 1))
        times.append(nc.replay_time(dec, 20, R, heads))
    print(f"pass over R = 1..{nc.DECODE_MAX_ROWS} rows, {heads} head(s), us: " + " ".join(f"{t:.1f}" for t in times))

n = cfg.T - len(prompt) - 1
params = ne.carve(flat, cfg)
seq = prompt + list(ne.generate(params, cfg, prompt, n, temperature=0) if cpu else
                    nc.generate(dec, cfg, prompt, n, temperature=0))
_, xf = ne.model_forward(params, cfg, np.array([seq]))
xf = xf[0]
ranks = np.full((cfg.K, len(seq)), -1)
for k in range(cfg.K):
    logits = xf @ params["heads"][k].T                                   # (N, V)
    for t in range(len(prompt) - 1, len(seq) - 1 - k):
        ranks[k, t] = int((logits[t] > logits[t, seq[t + 1 + k]]).sum())
gen = slice(len(prompt) - 1, len(seq) - 1)
print(f"{len(seq) - len(prompt)} greedy tokens; head 0 of the float32 forward agrees at "
      f"{np.mean(ranks[0, gen] == 0):.3f} of them")
for k in range(1, cfg.K):
    r = ranks[k][ranks[k] >= 0]
    print(f"head {k}: right in its best 1/2/4/8 guesses at " + " / ".join(f"{np.mean(r < w):.3f}" for w in (1, 2, 4, 8)))


def tokens_per_pass(widths, full):
    """walk the greedy sequence pass by pass: a pass at certain token i, fed with drafts from row i-1"""
    i, passes, start, end = len(prompt), 0, len(prompt), len(seq) - cfg.K
    while i < end:
        m = 0
        for d, w in enumerate(widths, 1):
            r = ranks[d, i - 1]
            if r >= w:
                break
            m = d
            if r > 0 and not full:
                break                      # a side guess of the chain: nothing below it
        i += 1 + m
        passes += 1
    return (i - start) / passes


def rows(widths, full):
    return 1 + (sum(np.prod(widths[:d + 1]) for d in range(len(widths))) if full else sum(widths))


results = []
for depth in (1, 2, 3):
    for widths in itertools.product((1, 2, 3, 4, 6, 7), repeat=depth):
        for full in (True, False):
            R = rows(list(widths), full)
            if R <= nc.DECODE_MAX_ROWS and (full or depth > 1):
                results.append((R, tokens_per_pass(list(widths), full), widths, "full" if full else "chain"))
best = {}
for R, tpp, widths, kind in results:
    if tpp > best.get(R, (0,))[0]:
        best[R] = (tpp, widths, kind)
for R in sorted(best):
    tpp, widths, kind = best[R]
    print(f"  {R} rows: {tpp:.3f} tokens a pass, widths {widths} ({kind})")
print("  the chain of 1..3 drafts (today's): " +
      " / ".join(f"{tokens_per_pass([1] * d, True):.3f}" for d in (1, 2, 3)))
if len(sys.argv) > 2:
    np.savez(sys.argv[2], ranks=ranks, seq=np.array(seq))
