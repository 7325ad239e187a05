#!/bin/bash
# Short decoding A/B of the working tree against ab_base/ (made by hand: mkdir ab_base && git
# archive REF | tar -x -C ab_base) on one GPU, most telling first ($OUT: summary.log and logs):
# check; the rows probe in both; bench --decode-only --profile on random weights in both; then
# train big, sft and bench --decode-only on that SFT model in both.
source "$(dirname "$0")/gpu_common.sh"
run_check
rows_probe . ab_base
for tree in . ab_base; do
  echo "== random weights, $tree" | tee -a "$S"
  (cd $tree && python nanoeuler_cuda.py bench --decode-only --profile 2>&1) | grep -E "tok/s|a pass over" | tee -a "$S"
done
python nanoeuler_cuda.py train big --steps 600 --out out/big > "$R/train.log" 2>&1
python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft > "$R/sft.log" 2>&1
M=$PWD/out/sft/best.safetensors
for tree in . ab_base; do
  echo "== SFT model, $tree" | tee -a "$S"
  (cd $tree && python nanoeuler_cuda.py bench --decode-only --model $M 2>&1) | grep -E "tok/s|prefill" | tee -a "$S"
done
