#!/bin/bash
# The qkv product and attention in one kernel (issue 35, DECODE_QKV_ATTENTION) on one GPU, in one
# call (measured 2026-12-05 by dev/gpu/ab_2026-12-05.sh instead: 14% slower; dev/LOG-decode.md): from the
# root of a copy of the tree with dev/variants/decode_qkv_attention.diff applied by `patch -p1` (git apply
# run inside this repository's folder applies nothing, silently),
#     bash dev/variants/gpu_decode_qkv_attention.sh OUTDIR MAIN [TREE...]
# MAIN: a checkout of main without it; TREE: copies of the applied tree with a variant on top
# (decode_qkv_attention_count_late.diff). check; bench --decode-only on random weights in this tree
# (with --decode-variants: the two-kernel form and the other variants in the same process, their
# tokens compared), MAIN and each TREE, alternating, twice, the first round with --profile; the
# README's flow model (train big --mtp-weight 1.5, sft) and bench --decode-only on it in every
# tree; PyTorch's best decoding. Every step under a timeout: a kernel whose attention blocks never
# see their count would hang the rest. Writes 14 files: give OUTDIR under /tmp and tar it into $OUT
# (a device command brings back 8 files at most).
source "$(dirname "$0")/../gpu/common.sh"
MAIN=${1:?usage: bash $0 OUTDIR MAIN [TREE...]}; shift
name() { [ "$1" = . ] && echo this || { [ "$1" = "$MAIN" ] && echo main || basename "$1"; }; }
keep="tok/s|a pass over|one step|prefill|same tokens|decoding on|rror"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$S"
run_check
for round in 1 2; do
  for tree in . "$MAIN" "$@"; do
    name=$(name "$tree")_$round
    opts=$([ "$tree" = . ] && echo --decode-variants)$([ $round = 1 ] && echo " --profile")
    echo "== random weights, $name ($opts)" | tee -a "$S"
    (cd "$tree" && timeout 150 python nanoeuler_cuda.py bench --decode-only $opts > "$R/bench_random_$name.log" 2>&1)
    echo "rc $?" | tee -a "$S"; grep -E "$keep" "$R/bench_random_$name.log" | grep -v "^    [a-z_]" | tee -a "$S"
  done
done
t train.log timeout 120 python nanoeuler_cuda.py train big --mtp-weight 1.5 --out out/big
t sft.log timeout 100 python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
M=$PWD/out/sft/best.safetensors
for tree in . "$MAIN" "$@"; do
  name=$(name "$tree")
  echo "== flow's SFT model (--mtp-weight 1.5), $name" | tee -a "$S"
  (cd "$tree" && timeout 90 python nanoeuler_cuda.py bench --decode-only --model $M > "$R/bench_flow_$name.log" 2>&1)
  grep -E "$keep" "$R/bench_flow_$name.log" | tee -a "$S"
done
t torch_decode.log timeout 150 python tools/pytorch_reference.py --decode --compile reduce-overhead
tail -1 "$R/torch_decode.log" | tee -a "$S"
