#!/bin/bash
# BASE must be a commit that has landed: the device copy of the repository holds no other (there,
# make the reference tree by hand as docs/gpu_decode_ab2.sh expects).
# A/B of the working tree against $BASE (default HEAD) on one GPU (BASE=REF bash docs/gpu_ab.sh; $OUT: summary.log and
# logs): check on the working tree, then bench big at batch 64 and 16 interleaved, the two trees
# in turn, then the working tree's --profile and its decoding profile.
source "$(dirname "$0")/gpu_common.sh"
rm -rf ab && mkdir ab && git archive ${BASE:-HEAD} | tar -x -C ab --one-top-level=base
run_check
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
