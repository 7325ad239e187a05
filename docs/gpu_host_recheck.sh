#!/bin/bash
# The closing device run of a host-side change (bash docs/gpu_host_recheck.sh; $OUT: summary.log,
# the chat transcripts and logs.tgz), about 4 minutes on an H200: check; the README's flow (train
# big, sft, chat greedy and --speculative, decoding speed on that SFT model); bench's flags refused
# before a GPU starts; the GPU tests of test_nanoeuler.py.
source "$(dirname "$0")/gpu_common.sh"
L=$R/logs; mkdir -p "$L"
run_check && mv "$R/check.log" "$L/"
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
for flags in "huge" "--decode-precision fp8" "--decode-only --no-decode"; do
  python nanoeuler_cuda.py bench $flags 2>&1 | tail -1 | sed "s/^/bench $flags: /" | tee -a "$S"
done
t pytest_gpu.log python -m pytest -q -p no:cacheprovider test_nanoeuler.py -k "gpu or GPU or data_parallel or launcher"
tail -2 "$R/pytest_gpu.log" | tee -a "$S"; mv "$R/pytest_gpu.log" "$L/"
(cd "$R" && tar -czf logs.tgz logs && rm -rf logs)
