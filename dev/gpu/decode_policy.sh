#!/bin/bash
# Issue 35's drafting policy and one cheaper-pass variant on one GPU, in one call (bash
# dev/gpu/decode_policy.sh OUTDIR): check; bench --decode-only --profile on random weights in this
# tree, in ab_base (main before the policy: git archive) and in ab_early (this tree with
# dev/variants/decode_residual_early.diff); PyTorch's best decoding; the README's flow model
# (train big --mtp-weight 1.5, sft) and bench --decode-only on it in the three trees; check in ab_early.
source "$(dirname "$0")/common.sh"
keep="tok/s|a pass over|one step|prefill|rror"
trees=". ab_base ab_early"
run_check
for tree in $trees; do
  echo "== random weights, $tree" | tee -a "$S"
  (cd $tree && timeout 120 python nanoeuler_cuda.py bench --decode-only --profile > "$R/bench_random_${tree#ab_}.log" 2>&1)
  grep -E "$keep" "$R/bench_random_${tree#ab_}.log" | grep -v "^    " | tee -a "$S"
done
t torch_decode.log timeout 150 python tools/pytorch_reference.py --decode --compile reduce-overhead
tail -2 "$R/torch_decode.log" | tee -a "$S"
t train.log python nanoeuler_cuda.py train big --mtp-weight 1.5 --out out/big
t sft.log python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
M=$PWD/out/sft/best.safetensors
for tree in $trees; do
  echo "== flow's SFT model (--mtp-weight 1.5), $tree" | tee -a "$S"
  (cd $tree && timeout 60 python nanoeuler_cuda.py bench --decode-only --model $M > "$R/bench_flow_${tree#ab_}.log" 2>&1)
  grep -E "$keep" "$R/bench_flow_${tree#ab_}.log" | tee -a "$S"
done
(cd ab_early && timeout 90 python nanoeuler_cuda.py check > "$R/check_early.log" 2>&1)
echo "ab_early check: $(grep -c ' OK$' "$R/check_early.log") OK, $(grep -c 'NOT OK' "$R/check_early.log") NOT OK" | tee -a "$S"
grep "NOT OK" "$R/check_early.log" | head | tee -a "$S"
