#!/bin/bash
# Issue 40 on one GPU (bash dev/gpu/async_save.sh OUTDIR; OUTDIR: summary.log and the logs),
# about 110 s: (1) dev/gpu/async_save_probe.py: what a checkpoint of the big model held the
# training loop for before (pageable copies, then the write) and now (page-locked copies; the
# write beside the steps), and the step time during a write; (2) a soak: train big --minutes 1.2
# --save-minutes 0.2 (a save every 12 s, about 6): wall time against the 72 s asked, the loop's
# time held per save and each write's, the steps during writes against the others, and the share
# of the wall outside steps and evaluations. The checkpoints go to out/ (the local disk, not
# OUTDIR) and are deleted after. The issue's 10-minute run with default flags (about 11 minutes):
# SOAK="--minutes 10" bash dev/gpu/async_save.sh OUTDIR.
source "$(dirname "$0")/common.sh"
SOAK=${SOAK:---minutes 1.2 --save-minutes 0.2 --eval-every 1000}
minutes=$(echo "$SOAK" | sed -E 's/.*--minutes ([0-9.]+).*/\1/')
t probe.log python dev/gpu/async_save_probe.py out/async_probe
grep -E "^(GPU|before|after)|rror" "$R/probe.log" | tee -a "$S"
rm -rf out/async_soak
t soak.log python nanoeuler_cuda.py train big $SOAK --out out/async_soak
grep -E "^(plan|saved|done)|rror|note" "$R/soak.log" | tee -a "$S"
python - "$R/soak.log" "$S" "$minutes" <<'PY' | tee -a "$S"
import re, statistics, sys
log, asked = open(sys.argv[1]).read(), float(sys.argv[3]) * 60
wall = float(re.findall(r"\[timing\] python nanoeuler_cuda.py train big[^:]*: ([0-9.]+) s", open(sys.argv[2]).read())[-1])
steps = {int(s): float(ms) for s, ms in re.findall(r"^step +(\d+)/\d+ \|.*?\| +([0-9.]+) ms", log, re.M)}
saves = [(int(s), float(took), float(held)) for s, took, held in
         re.findall(r"^saved  \S+model_(\d+)\.safetensors \(\+ state\) in ([0-9.]+) s, training held ([0-9.]+) s", log, re.M)]
typical = statistics.median(steps.values())
# a write runs beside the steps after its save: as many as fit in its time at the typical step
during = [ms for s, took, _ in saves[:-1] for k, ms in steps.items() if s < k <= s + took / (typical / 1e3)]
held = sum(h for _, _, h in saves)
print(f"soak: wall {wall:.1f} s for --minutes {asked / 60:g} ({asked:g} s): {100 * (wall / asked - 1):+.1f}%; "
      f"{len(saves)} saves held "
      f"training {held:.2f} s in all ({100 * held / wall:.2f}% of the wall), each "
      f"{', '.join(f'{h:.3f}' for _, _, h in saves)} s; writes {', '.join(f'{t:.1f}' for _, t, _ in saves)} s")
evals = len(re.findall(r"^val ", log, re.M))
plan = re.search(r"([0-9.]+) s an evaluation", log)
steps_s = re.search(r"done: .*?: ([0-9.]+) s of steps", log)
if plan and steps_s:
    rest = wall - float(steps_s.group(1)) - evals * float(plan.group(1))
    print(f"soak: {float(steps_s.group(1)):.1f} s of steps, {evals} evaluations of about {plan.group(1)} s (the plan's "
          f"timing), the rest {rest:.1f} s = {100 * rest / wall:.1f}% of the wall (start-up and data included)")
if during:
    print(f"soak: step median {typical:.2f} ms; {len(during)} steps during writes: median "
          f"{statistics.median(during):.2f} ms, slowest {max(during):.1f} ms")
PY
rm -rf out/async_soak
