#!/bin/bash
# Training A/B of the working tree against a copy of the reference tree in ab_base/ (made by
# hand: mkdir ab_base && git archive REF | tar -x -C ab_base), on one GPU ($OUT: summary.log
# and the logs): check; bench big at batch 64 and 16, the trees in turn, twice; PyTorch
# (torch.compile with CUDA graphs) at 64 and 16; the working tree's profile at 64 (the step's
# GPU time replayed from its graph, beside its wall time).
source "$(dirname "$0")/gpu_common.sh"
run_check
for round in 1 2; do
  for b in 64 16; do
    for tree in . ab_base; do
      (cd $tree && python nanoeuler_cuda.py bench big --batch $b --no-decode) > "$R/b.log" 2>&1
      echo "round $round b$b $tree: $(grep -E 'ms/step|rror' "$R/b.log" | tail -1)" | tee -a "$S"
    done
  done
done
rm -f "$R/b.log"
for b in 64 16; do
  t torch_b$b.log python docs/pytorch_reference.py --compile reduce-overhead --batch $b
  grep -E "^PyTorch|Error" "$R/torch_b$b.log" | tail -2 | tee -a "$S"
done
t profile.log python nanoeuler_cuda.py bench big --batch 64 --profile --no-decode
grep -E "ms/step|replayed" "$R/profile.log" | tee -a "$S"
