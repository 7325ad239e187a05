#!/bin/bash
# Training A/B of the working tree against copies of other trees (bash dev/gpu/train_ab.sh OUTDIR
# [TREE...], default ab_base, each made by hand: mkdir ab_base && git archive REF | tar -x -C
# ab_base) on one GPU (OUTDIR: summary.log and the logs): check (its TMA product lines too); the big
# model's bf16 steps the same bits from the graph twice and kernel by kernel (dev/gpu/step_bits.py;
# stops before the timings if not); bench big at batch 64 and 16, the trees in turn, twice; each
# tree's attention, product and SwiGLU timing (bench --profile at 64); PyTorch (torch.compile with
# CUDA graphs) at 64 and 16 unless PYTORCH=0 (ROUNDS=1: one round; TORCH_BATCHES=64: PyTorch at 64
# alone). (For a change of the products: PRODUCT_TMA = True, or PRODUCT_TMA_BACKWARD = True, in the
# working tree.)
source "$(dirname "$0")/common.sh"
trees=". ${*:-ab_base}"
run_check
grep -E "^ *product" "$R/check.log" | tee -a "$S"
t step_bits.log timeout 150 python dev/gpu/step_bits.py
tail -2 "$R/step_bits.log" | tee -a "$S"
if ! grep -q "the same in all three" "$R/step_bits.log"; then    # (a hang or wrong bits: the timings would mislead)
  echo "step_bits did not pass: stopping before the timings" | tee -a "$S"; exit 1
fi
for round in ${ROUNDS:-1 2}; do
  for b in 64 16; do
    for tree in $trees; do
      (cd $tree && python nanoeuler_cuda.py bench big --batch $b --no-decode) > "$R/b.log" 2>&1
      echo "round $round b$b $tree: $(grep -E 'ms/step|rror' "$R/b.log" | tail -1)" | tee -a "$S"
    done
  done
done
rm -f "$R/b.log"
for tree in $trees; do
  (cd $tree && python nanoeuler_cuda.py bench big --batch 64 --profile --no-decode) > "$R/profile_${tree//\//_}.log" 2>&1
  echo "profile $tree: $(grep -E 'replayed|attention_forward|attention_backward|attention of one|matmul|swiglu' "$R/profile_${tree//\//_}.log" | tr -s ' ' | tr '\n' ';')" | tee -a "$S"
done
if [ "${PYTORCH:-1}" != 0 ]; then
  for b in ${TORCH_BATCHES:-64 16}; do
    t torch_b$b.log python tools/pytorch_reference.py --compile reduce-overhead --batch $b
    grep -E "^PyTorch|Error" "$R/torch_b$b.log" | tail -2 | tee -a "$S"
  done
fi
