#!/bin/bash
# bench --decode-only --profile (random weights) in the working tree and in copies of other trees
# (bash dev/gpu/decode_profile.sh OUTDIR TREE..., each made by hand as in dev/gpu/decode_ab.sh), one
# tree after another, twice round: GPU time of a pass over 1-4 rows, plain and speculative tok/s
source "$(dirname "$0")/common.sh"
trees=". $*"
for round in 1 2; do
  for tree in $trees; do
    echo "== random weights, $tree" | tee -a "$S"
    (cd $tree && python nanoeuler_cuda.py bench --decode-only --profile 2>&1) |
      grep -E "plain KV|1 draft|a pass over [1-4] rows? and 1 head|rror" | tee -a "$S"
  done
done
