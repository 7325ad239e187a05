#!/bin/bash
# The closing device run of a change (bash docs/gpu_final.sh; $OUT: summary.log, the chat
# transcripts and logs.tgz), about 7 minutes on an H200: check; bench big at batch 64 and 16;
# PyTorch (torch.compile with CUDA graphs) at 64 and 16; bench at 64 and 16 again; then the
# README's flow: train big, sft, chat greedy and --speculative, decoding speed on that SFT model;
# then decoding on random weights beside PyTorch's best (496 new tokens each). (On 2026-12-02 the
# last two ran as a command of their own after the rest: docs/logs_h200_final/decode_vs_pytorch_summary.log.)
source "$(dirname "$0")/gpu_common.sh"
L=$R/logs; mkdir -p "$L"
run_check && mv "$R/check.log" "$L/"
bench() { t bench_b$1_$2.log python nanoeuler_cuda.py bench big --batch $1 --no-decode; grep -E "ms/step|rror" "$R/bench_b$1_$2.log" | tee -a "$S"; mv "$R/bench_b$1_$2.log" "$L/"; }
bench 64 1; bench 16 1
for b in 64 16; do
  t torch_b$b.log python docs/pytorch_reference.py --compile reduce-overhead --batch $b
  grep -E "^PyTorch|Error" "$R/torch_b$b.log" | tail -2 | tee -a "$S"; mv "$R/torch_b$b.log" "$L/"
done
bench 64 2; bench 16 2
t train.log python nanoeuler_cuda.py train big --out out/big
grep -vE "^step |^sample" "$R/train.log" | tail -3 | tee -a "$S"; mv "$R/train.log" "$L/"
t sft.log python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
grep -vE "^step |^sample" "$R/sft.log" | tail -3 | tee -a "$S"; mv "$R/sft.log" "$L/"
M=out/sft/best.safetensors
printf 'What is the capital of France?\nGive me three tips for staying healthy.\nWhat is a good name for a cat?\n/reset\nWho wrote Romeo and Juliet?\n/quit\n' > /tmp/chat_in.txt
for mode in greedy spec; do                    # (not through t, which reads /dev/null)
  s=$EPOCHREALTIME
  python nanoeuler_cuda.py chat --model $M --temperature 0 --max-new-tokens 80 $([ $mode = spec ] && echo --speculative) \
    < /tmp/chat_in.txt > "$R/chat_$mode.log" 2>&1
  echo "[timing] chat $mode: $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s" | tee -a "$S"
done
cmp -s <(grep -vi specul "$R/chat_greedy.log") <(grep -vi specul "$R/chat_spec.log") && echo "chat: speculative's replies == greedy's" | tee -a "$S"
t decode_sft.log python nanoeuler_cuda.py bench --decode-only --model $M
grep -hE "tok/s|prefill" "$R/decode_sft.log" | tee -a "$S"; mv "$R/decode_sft.log" "$L/"
t decode_random.log python nanoeuler_cuda.py bench --decode-only --max-new-tokens 496
grep -hE "tok/s|prefill" "$R/decode_random.log" | tee -a "$S"; mv "$R/decode_random.log" "$L/"
t torch_decode.log timeout 150 python docs/pytorch_reference.py --decode --compile reduce-overhead
grep -E "tok/s|rror" "$R/torch_decode.log" | tail -3 | tee -a "$S"; mv "$R/torch_decode.log" "$L/"
(cd "$R" && tar -czf logs.tgz logs && rm -rf logs)
