#!/bin/bash
# Short decoding A/B of the working tree against copies of other trees (bash dev/gpu/decode_ab.sh OUTDIR
# [TREE...], default ab_base, each made by hand: mkdir ab_base && git archive REF | tar -x -C
# ab_base; a variant: the same into ab_x, then git apply --directory=ab_x dev/variants/X.diff) on one GPU, most
# telling first (OUTDIR: summary.log and logs): check; the rows probe in each tree; bench
# --decode-only --profile on random weights in each; then train big, sft and bench --decode-only
# on that SFT model in each.
source "$(dirname "$0")/common.sh"
trees=". ${*:-ab_base}"
run_check
rows_probe $trees
for tree in $trees; do
  echo "== random weights, $tree" | tee -a "$S"
  (cd $tree && python nanoeuler_cuda.py bench --decode-only --profile 2>&1) | grep -E "tok/s|a pass over|rror" | tee -a "$S"
done
python nanoeuler_cuda.py train big --steps 600 --out out/big > "$R/train.log" 2>&1
python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft > "$R/sft.log" 2>&1
M=$PWD/out/sft/best.safetensors
for tree in $trees; do
  echo "== SFT model, $tree" | tee -a "$S"
  (cd $tree && python nanoeuler_cuda.py bench --decode-only --model $M 2>&1) | grep -E "tok/s|prefill|rror" | tee -a "$S"
done
