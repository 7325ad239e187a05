#!/bin/bash
# Which step of the README flow does the epilogue add (dev/variants/residual_add_in_product_epilogue.diff) change?
# bash dev/gpu/epilogue_flow.sh OUTDIR TREE: TREE is main with the diff applied (patch -p1). check in TREE; then in
# main and in TREE: train big --mtp-weight 1.5, decoding (drafts) on its pre-trained model, sft, decoding on the SFT
# model. About 4 minutes on one H100.
source "$(dirname "$0")/common.sh"
T=$(realpath "${1:?usage: bash $0 OUTDIR TREE}")
(cd "$T" && run_check)
for tree in "$PWD" "$T"; do
  echo "== $tree" | tee -a "$S"
  (cd "$tree"
   t train.log python nanoeuler_cuda.py train big --mtp-weight 1.5 --out out/big
   grep -E "^done" "$R/train.log" | cut -c1-200 | tee -a "$S"
   python nanoeuler_cuda.py bench --decode-only --model out/big/best.safetensors 2>&1 | grep -E "tok/s" | head -2 | tee -a "$S"
   t sft.log python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
   grep -E "^done" "$R/sft.log" | cut -c1-200 | tee -a "$S"
   grep -E "^step +(100|200|300|400|500|600)/" "$R/sft.log" | cut -c1-120 | tee -a "$S"
   python nanoeuler_cuda.py bench --decode-only --model out/sft/best.safetensors 2>&1 | grep -E "tok/s" | head -2 | tee -a "$S")
done
