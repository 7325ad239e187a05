#!/bin/bash
# Decoding A/B of the working tree against a copy of the reference tree in ab_base/ (made by
# hand: mkdir ab_base && git archive REF | tar -x -C ab_base), on one GPU ($OUT: summary.log and
# the logs): check, the rows probe in both, train big and sft, bench --decode-only on that SFT
# model in both trees in turn, twice, and the working tree's decoding profile.
source "$(dirname "$0")/gpu_common.sh"
run_check
rows_probe . ab_base
t train.log python nanoeuler_cuda.py train big --steps 600 --out out/big
grep -E "^done" "$R/train.log" | tee -a "$S"
t sft.log python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
grep -E "^done" "$R/sft.log" | tee -a "$S"
M=$PWD/out/sft/best.safetensors
for round in 1 2; do
  for tree in . ab_base; do
    echo "== round $round, $tree" | tee -a "$S" >> "$R/decode_ab.log"
    (cd $tree && python nanoeuler_cuda.py bench --decode-only --model $M) > "$R/d.log" 2>&1
    cat "$R/d.log" >> "$R/decode_ab.log"; grep -E "tok/s|prefill|rror" "$R/d.log" | tee -a "$S"
  done
done
rm -f "$R/d.log"
t decode_profile.log python nanoeuler_cuda.py bench --decode-only --profile --model $M
grep -E "replayed|a pass over" "$R/decode_profile.log" | tee -a "$S"
