#!/bin/bash
# The day's new features on one GPU, in one call (bash dev/gpu/features.sh OUTDIR): check; the README's
# flow (train big --mtp-weight 1.5, sft, chat, decoding speed), whose models the next scripts use;
# then dev/gpu/serve_smoke.sh, multinode_world1.sh and eval.sh, each into its own folder of OUTDIR
# with its own time limit. OUTDIR: summary.log (every script's summary after the others) and logs.tgz.
source "$(dirname "$0")/common.sh"
L=$R/logs; mkdir -p "$L"
run_check && mv "$R/check.log" "$L/"
readme_flow
for part in "serve_smoke 60" "multinode_world1 120" "eval 200"; do
  set -- $part
  echo "== dev/gpu/$1.sh (limit $2 s)" | tee -a "$S"
  s=$EPOCHREALTIME
  timeout $2 bash dev/gpu/$1.sh "$L/$1" > "$L/$1.out" 2>&1; rc=$?
  echo "[timing] dev/gpu/$1.sh: $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s, rc $rc" | tee -a "$S"
  cat "$L/$1/summary.log" >> "$S" 2>/dev/null
done
(cd "$R" && tar -czf logs.tgz logs && rm -rf logs)
