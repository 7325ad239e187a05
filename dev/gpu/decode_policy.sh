#!/bin/bash
# Speculative decoding's drafting policy (issue 35) on one GPU, in one call (bash dev/gpu/decode_policy.sh
# OUTDIR [TREE...]): check; bench --decode-only --profile on random weights in this tree, bench
# --decode-only in each TREE (copies of other trees or variants, made by hand as decode_ab.sh says);
# the README's flow model (train big --mtp-weight 1.5, sft) and bench --decode-only on it in this tree
# and each TREE; PyTorch's best decoding. 2026-12-04's first run (logs/2026-12-04_decode35/1_policy)
# had ab_base (main before the policy) and ab_early (the residual's old value loaded early, kept since).
source "$(dirname "$0")/common.sh"
keep="tok/s|a pass over|one step|prefill|rror"
run_check
for tree in . "$@"; do
  name=$([ $tree = . ] && echo this || echo ${tree#ab_}); profile=$([ $tree = . ] && echo --profile)
  echo "== random weights, $tree" | tee -a "$S"
  (cd $tree && timeout 120 python nanoeuler_cuda.py bench --decode-only $profile > "$R/bench_random_$name.log" 2>&1)
  grep -E "$keep" "$R/bench_random_$name.log" | grep -v "^    " | tee -a "$S"
done
t train.log python nanoeuler_cuda.py train big --mtp-weight 1.5 --out out/big
t sft.log python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
M=$PWD/out/sft/best.safetensors
for tree in . "$@"; do
  name=$([ $tree = . ] && echo this || echo ${tree#ab_})
  echo "== flow's SFT model (--mtp-weight 1.5), $tree" | tee -a "$S"
  (cd $tree && timeout 60 python nanoeuler_cuda.py bench --decode-only --model $M > "$R/bench_flow_$name.log" 2>&1)
  grep -E "$keep" "$R/bench_flow_$name.log" | tee -a "$S"
done
t torch_decode.log timeout 150 python tools/pytorch_reference.py --decode --compile reduce-overhead
tail -1 "$R/torch_decode.log" | tee -a "$S"
