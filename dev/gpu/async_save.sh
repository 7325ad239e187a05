#!/bin/bash
# Issue 40 on one GPU (bash dev/gpu/async_save.sh OUTDIR; OUTDIR: summary.log and the logs),
# about 110 s: (1) dev/gpu/async_save_probe.py: what a checkpoint of the big model held the
# training loop for before (pageable copies, then the write) and now (page-locked copies; the
# write beside the steps), and the step time during a write; (2) a soak: train big --minutes 1.2
# --save-minutes 0.2 (a save every 12 s, about 6): wall time against the 72 s asked, the loop's
# time held per save and each write's, the steps during writes against the others. The
# checkpoints go to out/ (the local disk, not OUTDIR) and are deleted after.
source "$(dirname "$0")/common.sh"
t probe.log python dev/gpu/async_save_probe.py out/async_probe
grep -E "^(GPU|before|after)|rror" "$R/probe.log" | tee -a "$S"
rm -rf out/async_soak
t soak.log python nanoeuler_cuda.py train big --minutes 1.2 --save-minutes 0.2 --eval-every 1000 --out out/async_soak
grep -E "^(plan|saved|done)|rror|note" "$R/soak.log" | tee -a "$S"
python - "$R/soak.log" "$S" <<'PY' | tee -a "$S"
import re, statistics, sys
log = open(sys.argv[1]).read()
wall = float(re.findall(r"\[timing\] python nanoeuler_cuda.py train big[^:]*: ([0-9.]+) s", open(sys.argv[2]).read())[-1])
steps = {int(s): float(ms) for s, ms in re.findall(r"^step +(\d+)/\d+ \|.*?\| +([0-9.]+) ms", log, re.M)}
saves = [(int(s), float(took), float(held)) for s, took, held in
         re.findall(r"^saved  \S+model_(\d+)\.safetensors \(\+ state\) in ([0-9.]+) s, training held ([0-9.]+) s", log, re.M)]
typical = statistics.median(steps.values())
# a write runs beside the steps after its save: as many as fit in its time at the typical step
during = [ms for s, took, _ in saves[:-1] for k, ms in steps.items() if s < k <= s + took / (typical / 1e3)]
held = sum(h for _, _, h in saves)
print(f"soak: wall {wall:.1f} s for --minutes 1.2 (72 s): {100 * (wall / 72 - 1):+.1f}%; {len(saves)} saves held "
      f"training {held:.2f} s in all ({100 * held / wall:.2f}% of the wall), each "
      f"{', '.join(f'{h:.3f}' for _, _, h in saves)} s; writes {', '.join(f'{t:.1f}' for _, t, _ in saves)} s")
if during:
    print(f"soak: step median {typical:.2f} ms; {len(during)} steps during writes: median "
          f"{statistics.median(during):.2f} ms, slowest {max(during):.1f} ms")
PY
rm -rf out/async_soak
