#!/bin/bash
# Issue 36: the bf16 forward's products by flash_attn.cu's TMA product and SwiGLU in w_gate_up's epilogue
# (nanoeuler_cuda.PRODUCT_TMA; never run on a GPU before this) against other trees, on one H100 or H200 (bash
# dev/gpu/product_ab.sh OUTDIR [TREE...], from the repository root; default ab_base, each tree made by hand: mkdir
# ab_base && git archive main | tar -x -C ab_base): check (its "product" lines: the big model's four products and
# w_gate_up's with SwiGLU against float64, s the same bits as swiglu_forward's from gu); the big model's bf16 steps
# from its graph twice and kernel by kernel, the same bits (dev/gpu/step_bits.py; stops before the timings if not);
# bench big --no-decode at batch 64 and 16 in every tree, twice; bench --profile at 64 in every tree (the products'
# and swiglu_forward's ms a step). About 4 minutes with two trees.
source "$(dirname "$0")/common.sh"
trees=". ${*:-ab_base}"
run_check
grep -E "^product" "$R/check.log" | tee -a "$S"
t step_bits.log timeout 150 python dev/gpu/step_bits.py
cat "$R/step_bits.log" | tee -a "$S"
if ! grep -q "the same in all three" "$R/step_bits.log"; then    # (a hang or wrong bits: the timings would mislead)
  echo "step_bits did not pass: stopping before the timings" | tee -a "$S"; exit 1
fi
for round in 1 2; do
  for b in 64 16; do
    for tree in $trees; do
      (cd $tree && timeout 120 python nanoeuler_cuda.py bench big --batch $b --no-decode) > "$R/b.log" 2>&1
      echo "round $round b$b $tree: $(grep -E 'ms/step|rror' "$R/b.log" | tail -1)" | tee -a "$S"
    done
  done
done
rm -f "$R/b.log"
for tree in $trees; do
  log="$R/profile_${tree//\//_}.log"
  (cd $tree && timeout 120 python nanoeuler_cuda.py bench big --batch 64 --profile --no-decode) > "$log" 2>&1
  echo "profile $tree: $(grep -E 'replayed|matmul|swiglu' "$log" | tr -s ' ' | tr '\n' ';')" | tee -a "$S"
done
echo "done at $(date -u)" | tee -a "$S"
