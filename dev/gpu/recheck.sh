#!/bin/bash
# A short device run after a kernel change (bash dev/gpu/recheck.sh OUTDIR; OUTDIR: summary.log and the
# logs), about 4 minutes on an H200: check; bench big --profile at batch 16 and 64; PyTorch
# (torch.compile with CUDA graphs) at 16 and 64 in the same run; bench at 64 again; train big.
source "$(dirname "$0")/common.sh"
run_check
for b in 16 64; do
  t bench_b${b}_profile.log python nanoeuler_cuda.py bench big --batch $b --profile
  grep -E "ms/step|replayed from its graph:|attention_backward|attention_forward|attention of one" "$R/bench_b${b}_profile.log" | tee -a "$S"
done
for b in 16 64; do
  t torch_b$b.log python tools/pytorch_reference.py --compile reduce-overhead --batch $b
  grep -E "^PyTorch|Error" "$R/torch_b$b.log" | tail -2 | tee -a "$S"
done
for b in 64 16; do
  t bench_b${b}_after.log python nanoeuler_cuda.py bench big --batch $b
  grep -E "ms/step" "$R/bench_b${b}_after.log" | tee -a "$S"
done
t train.log python nanoeuler_cuda.py train big --steps 600 --out out/big
grep -vE "^step |^sample" "$R/train.log" | tail -4 | tee -a "$S"
