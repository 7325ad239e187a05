#!/bin/bash
# issue 35: the wo product combining the split attention's chunks (ar), with DECODE_CHUNK 32 / 128
# (v2: combined once a block into shared memory), against main, random weights of big, bf16; check in ar; PyTorch's best decoding.
source dev/gpu/common.sh
here=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee -a "$S"
(cd .carry/ar && timeout 200 python nanoeuler_cuda.py check > "$R/check_ar.log" 2>&1)
echo "check (ar): rc $?, $(grep -c ' OK$' "$R/check_ar.log") OK, $(grep -c 'NOT OK' "$R/check_ar.log") NOT OK" | tee -a "$S"
grep "NOT OK" "$R/check_ar.log" | head | tee -a "$S"
for round in 1 2; do decode_round $round main ar ar128; done
# the README flow's model (train big --mtp-weight 1.5, sft), decoded by main and ar, twice
t train.log python nanoeuler_cuda.py train big --mtp-weight 1.5 --out out/big
grep -vE "^step |^sample" "$R/train.log" | tail -2 | tee -a "$S"
t sft.log python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
grep -vE "^step |^sample" "$R/sft.log" | tail -2 | tee -a "$S"
for round in 1 2; do for tree in main ar ar128; do
  [ $tree = main ] && dir=$here || dir=$here/.carry/$tree
  echo "== SFT model, round $round, $tree" | tee -a "$S" >> "$R/bench_sft.log"
  (cd "$dir" && timeout 60 python nanoeuler_cuda.py bench --decode-only --model $here/out/sft/best.safetensors > /tmp/b.log 2>&1)
  cat /tmp/b.log >> "$R/bench_sft.log"; grep -E "tok/s|prefill|rror" /tmp/b.log | tee -a "$S" > /dev/null
done; done
