#!/bin/bash
# BASE must be a commit that has landed: the device copy of the repository holds no other (there,
# make the reference tree by hand as docs/gpu_decode_ab2.sh expects).
# Decoding A/B of the working tree against $BASE (default HEAD) on one GPU, on the SFT model of
# the README's flow (BASE=REF bash docs/gpu_decode_ab.sh; $OUT: summary.log and the logs): check,
# train big, sft, then bench --decode-only on that model, the two trees in turn, twice; the
# working tree's decoding profile; PyTorch's compiled decoding in the same run.
source "$(dirname "$0")/gpu_common.sh"
rm -rf ab && mkdir ab && git archive ${BASE:-HEAD} | tar -x -C ab --one-top-level=base
run_check
t train.log python nanoeuler_cuda.py train big --steps 600 --out out/big
grep -E "^done" "$R/train.log" | tee -a "$S"
t sft.log python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
grep -E "^done" "$R/sft.log" | tee -a "$S"
M=$PWD/out/sft/best.safetensors
for round in 1 2; do
  for tree in . ab/base; do
    echo "== round $round, $tree" | tee -a "$S" >> "$R/decode_ab.log"
    (cd $tree && python nanoeuler_cuda.py bench --decode-only --model $M) > "$R/d.log" 2>&1
    cat "$R/d.log" >> "$R/decode_ab.log"; grep -E "tok/s|prefill" "$R/d.log" | tee -a "$S"
  done
done
rm -f "$R/d.log"
t decode_profile.log python nanoeuler_cuda.py bench --decode-only --profile --model $M
grep -E "replayed|a pass over" "$R/decode_profile.log" | tee -a "$S"
t torch_decode.log timeout 150 python docs/pytorch_reference.py --decode --compile reduce-overhead
tail -3 "$R/torch_decode.log" | tee -a "$S"
rm -rf ab
