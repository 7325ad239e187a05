#!/bin/bash
# The README flow on one GPU, short: train big, sft, chat greedy and speculative, decoding speed on the SFT model ($OUT: flow.log and the logs)
export PYTHONUNBUFFERED=1
O=$OUT; S=$O/flow.log
t() { local log=$1; shift; local s=$EPOCHREALTIME; "$@" < /dev/null > "$O/$log" 2>&1; local rc=$?; echo "[timing] $*: $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s, rc $rc" | tee -a $S; }
t train.log python nanoeuler_cuda.py train big --steps 600 --out out/big
grep -vE "^step |^sample" "$O/train.log" | tail -3 | tee -a "$S"
t sft.log python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
grep -vE "^step |^sample" "$O/sft.log" | tail -3 | tee -a "$S"
M=out/sft/best.safetensors
printf 'What is the capital of France?\nGive me three tips for staying healthy.\nWhat is a good name for a cat?\n/reset\nWho wrote Romeo and Juliet?\n/quit\n' > /tmp/chat_in.txt
s=$EPOCHREALTIME; python nanoeuler_cuda.py chat --model $M --temperature 0 --max-new-tokens 80 < /tmp/chat_in.txt > $O/chat_greedy.log 2>&1; echo "[timing] chat greedy: $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s" | tee -a $S
s=$EPOCHREALTIME; python nanoeuler_cuda.py chat --model $M --temperature 0 --max-new-tokens 80 --speculative < /tmp/chat_in.txt > $O/chat_spec.log 2>&1; echo "[timing] chat speculative: $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s" | tee -a $S
cmp -s <(grep -vi specul $O/chat_greedy.log) <(grep -vi specul $O/chat_spec.log) && echo "chat: speculative's replies == greedy's" | tee -a $S
t decode_sft.log python nanoeuler_cuda.py bench --decode-only --model $M
grep -hE "tok/s|prefill" "$O/decode_sft.log" | tee -a "$S"
