#!/bin/bash
# BASE must be a commit that has landed: the device copy of the repository holds no other (there,
# make the reference tree by hand as docs/gpu_decode_ab2.sh expects).
# A/B of the working tree against $BASE (default HEAD) on one GPU (BASE=REF bash docs/gpu_ab.sh; $OUT: summary.log and
# logs): check on the working tree, then bench big at batch 64 and 16 interleaved, the two trees
# in turn, then the working tree's --profile and its decoding profile.
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"; S=$R/summary.log; : > "$S"
t() {   # t LOG CMD...: CMD's output into $R/LOG, its wall time and rc into the summary
  local log=$1; shift
  local s=$EPOCHREALTIME
  "$@" < /dev/null > "$R/$log" 2>&1
  local rc=$?
  echo "[timing] $*: $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s, rc $rc" | tee -a "$S"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee -a "$S"
rm -rf ab && mkdir ab && git archive ${BASE:-HEAD} | tar -x -C ab --one-top-level=base
t check.log python nanoeuler_cuda.py check
echo "check: $(grep -c ' OK$' "$R/check.log") OK, $(grep -c 'NOT OK' "$R/check.log") NOT OK" | tee -a "$S"
grep "NOT OK" "$R/check.log" | head | tee -a "$S"
for round in 1 2; do
  for b in 64 16; do
    for tree in . ab/base; do
      echo "== round $round, batch $b, $tree" >> "$R/ab.log"
      (cd $tree && python nanoeuler_cuda.py bench big --batch $b --no-decode) >> "$R/ab.log" 2>&1
      echo "round $round b$b $tree: $(grep 'ms/step' "$R/ab.log" | tail -1)" | tee -a "$S"
    done
  done
done
t profile.log python nanoeuler_cuda.py bench big --batch 64 --profile
grep -E "ms/step|replayed|attention_|a pass over|matvec|attention of one" "$R/profile.log" | tee -a "$S"
rm -rf ab
