#!/bin/bash
# Is the epilogue add's SFT model (1.02 tokens a pass against main's 1.67) a bug, or which checkpoint sft keeps?
# bash dev/gpu/epilogue_drafts.sh OUTDIR TREE (TREE: main with dev/variants/residual_add_in_product_epilogue.diff).
# In main and in TREE: the README flow's train and sft, then decoding (drafts) on each SFT checkpoint kept (best,
# 500, 600). About 3.5 minutes on one H100.
source "$(dirname "$0")/common.sh"
T=$(realpath "${1:?usage: bash $0 OUTDIR TREE}")
for tree in "$PWD" "$T"; do
  echo "== $tree" | tee -a "$S"
  (cd "$tree"
   python nanoeuler_cuda.py train big --mtp-weight 1.5 --out out/big > /dev/null 2>&1
   python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft 2>&1 | grep -E "^done" | cut -c1-160 | tee -a "$S"
   for m in best model_000500 model_000600; do
     echo "-- $m: $(python nanoeuler_cuda.py bench --decode-only --model out/sft/$m.safetensors 2>&1 | grep -E '1 draft' | cut -c1-110)" | tee -a "$S"
   done)
done
