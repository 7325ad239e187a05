#!/bin/bash
# One device run for the training step's speed (issue 13), from the repository root, in one
# device command: bash docs/gpu_speed.sh   ($OUT: summary.log and logs.tar.gz). About 8 minutes on an H200:
# check; bench big at batch 16 and 64, each also with --profile; PyTorch (docs/pytorch_reference.py,
# torch.compile with CUDA graphs) at batch 16 and 64 in the same run; train big (600 steps, the
# README's figure); the GPU test that a resumed run is bit-identical; --gpus 1 against one GPU;
# then the rest of the README's flow on the trained model: sft, chat (greedy, speculative,
# sampled), sample, and decoding speed on both models.
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; O=/tmp/gpu_speed; mkdir -p "$R" "$O"     # every log in $O, tarred into $R at the end
S=$R/summary.log; : > "$S"                                 # in $R as it grows: a cut-off run keeps it
t() {   # t LOG CMD...: CMD's output into $O/LOG (its input: $T_IN or nothing), wall time and rc into the summary
  local log=$1; shift
  local s=$EPOCHREALTIME
  "$@" < "${T_IN:-/dev/null}" > "$O/$log" 2>&1
  local rc=$?
  echo "[timing] $*: $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s, rc $rc" | tee -a "$S"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1; } | tee -a "$S"
t check.log python nanoeuler_cuda.py check
echo "check: $(grep -c ' OK$' "$O/check.log") OK, $(grep -c 'NOT OK' "$O/check.log") NOT OK; $(tail -1 "$O/check.log")" | tee -a "$S"
grep "NOT OK" "$O/check.log" | head -20 | tee -a "$S"
for b in 16 64; do
  t bench_b$b.log python nanoeuler_cuda.py bench big --batch $b
  grep -E "ms/step" "$O/bench_b$b.log" | tee -a "$S"
  t bench_b${b}_profile.log python nanoeuler_cuda.py bench big --batch $b --profile
done
for b in 16 64; do
  t torch_b$b.log python docs/pytorch_reference.py --compile reduce-overhead --batch $b
  grep -E "^PyTorch|Error" "$O/torch_b$b.log" | tail -2 | tee -a "$S"
done
t bench_b16_after.log python nanoeuler_cuda.py bench big --batch 16
grep -E "ms/step" "$O/bench_b16_after.log" | tee -a "$S"
t train.log python nanoeuler_cuda.py train big --steps 600 --out out/big
grep -vE "^step |^sample" "$O/train.log" | tail -4 | tee -a "$S"
t test_resume.log python -m pytest -q -x test_nanoeuler.py -k test_gpu_training_resumes_bit_identically
tail -1 "$O/test_resume.log" | tee -a "$S"
# data parallel through NCCL with one rank (--gpus 1) against the one-GPU engine: the same losses, fp32 and bf16
for p in fp32 bf16; do
  run() { python nanoeuler_cuda.py train big --steps 20 --batch 8 --eval-batches 1 --warmup 5 --precision $p "$@"; }
  rm -rf /tmp/one /tmp/rank1
  run --out /tmp/one > "$O/gpus1_$p.log" 2>&1 && run --out /tmp/rank1 --gpus 1 >> "$O/gpus1_$p.log" 2>&1
  python - "$p" <<'PY' | tee -a "$S"
import sys, numpy as np
a, b = (np.loadtxt(f"/tmp/{d}/log.csv", delimiter=",", skiprows=1, usecols=1) for d in ("one", "rank1"))
print(f"--gpus 1 == one GPU ({sys.argv[1]}, 20 steps, losses as logged):", len(a) == 20 and np.array_equal(a, b), a[-1], b[-1])
PY
done
tar czf "$R/logs.tar.gz" -C "$O" .                           # so far (again at the end)
# the flow after train big: SFT, chat, sample, decoding speed
t sft.log python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
grep -vE "^step |^sample" "$O/sft.log" | tail -4 | tee -a "$S"
M=out/sft/best.safetensors
printf 'What is the capital of France?\nGive me three tips for staying healthy.\nWhat is a good name for a cat?\n/reset\nWho wrote Romeo and Juliet?\n/quit\n' > /tmp/chat_in.txt
T_IN=/tmp/chat_in.txt t chat_greedy.log python nanoeuler_cuda.py chat --model $M --temperature 0 --max-new-tokens 80
T_IN=/tmp/chat_in.txt t chat_speculative.log python nanoeuler_cuda.py chat --model $M --temperature 0 --max-new-tokens 80 --speculative
cmp -s <(grep -vi specul "$O/chat_greedy.log") <(grep -vi specul "$O/chat_speculative.log") &&
  echo "chat: speculative's replies == greedy's" | tee -a "$S"
T_IN=/tmp/chat_in.txt t chat_sampled.log python nanoeuler_cuda.py chat --model $M --seed 1 --max-new-tokens 80
t sample.log python nanoeuler_cuda.py sample --model out/big/best.safetensors --prompt "ROMEO:" --temperature 0 --max-new-tokens 60
t decode_sft.log python nanoeuler_cuda.py bench --decode-only --model $M
t decode_big.log python nanoeuler_cuda.py bench --decode-only --model out/big/best.safetensors
grep -hE "tok/s|prefill|agree" "$O/decode_sft.log" "$O/decode_big.log" | tee -a "$S"
cp out/big/log.csv "$O/train_log.csv"; cp out/sft/log.csv "$O/sft_log.csv"
tar czf "$R/logs.tar.gz" -C "$O" .
