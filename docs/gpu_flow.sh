#!/bin/bash
# one device run, from the repository root (bash docs/gpu_flow.sh; $OUT: where the logs go): check, the whole flow
# (train big -> sft -> chat), decoding speed on the trained models (PyTorch's: docs/gpu_next.sh)
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}
t() { local s=$EPOCHREALTIME; "$@"; local rc=$?; echo "[timing] $* : $(awk "BEGIN{print $EPOCHREALTIME - $s}") s (rc $rc)"; return $rc; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/flow.log
t python nanoeuler_cuda.py check 2>&1 | tee $O/check.log | grep -v " OK$"
t python nanoeuler_cuda.py train big --steps 600 --out out/big 2>&1 | tee $O/train.log | grep -v "^step " | tail -25 | tee -a $O/flow.log
t python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft 2>&1 | tee $O/sft.log | grep -v "^step " | tail -30 | tee -a $O/flow.log
M=out/sft/best.safetensors
printf 'What is the capital of France?\nGive me three tips for staying healthy.\nWhat is a good name for a cat?\n/reset\nWho wrote Romeo and Juliet?\n/quit\n' > /tmp/chat_in.txt
for s in "" "--speculative"; do
  t python nanoeuler_cuda.py chat --model $M --temperature 0 --max-new-tokens 80 $s < /tmp/chat_in.txt 2>&1 | tee -a $O/flow.log
done
t python nanoeuler_cuda.py chat --model $M --seed 1 --max-new-tokens 80 < /tmp/chat_in.txt 2>&1 | tee -a $O/flow.log
t python nanoeuler_cuda.py sample --model out/big/best.safetensors --prompt "ROMEO:" --temperature 0 --max-new-tokens 60 2>&1 | tee -a $O/flow.log
t python nanoeuler_cuda.py bench --decode-only --profile --model $M 2>&1 | tee $O/bench.log
t python nanoeuler_cuda.py bench --decode-only --model out/big/best.safetensors 2>&1 | tee -a $O/bench.log
cp out/big/log.csv $O/train_log.csv; cp out/sft/log.csv $O/sft_log.csv
