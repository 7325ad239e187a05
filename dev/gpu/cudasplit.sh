#!/usr/bin/env bash
# After nanoeuler_cuda.py's move-only reorder (issue 30): every moved part runs on the GPU.
#   bash dev/gpu/cudasplit.sh OUTDIR        (about 90 s on an H200; no network)
# check (every kernel and the model against numpy), then 30 steps of train small on one GPU
# (the training section) and through the --gpus 1 launcher (several GPUs: NCCL, one rank), whose
# losses must be the same bits, sample from that model (decoding), a short bench (benchmark), and
# decoding speed of big (bench --decode-only).
# Prints into OUTDIR/summary.log: check's OK / NOT OK counts, each command's time and exit code,
# the two runs' last step lines and whether their losses match, the sample, bench's rates.
cd "$(dirname "$0")/../.." && source dev/gpu/common.sh
run_check
W=$(mktemp -d)
t train.log python nanoeuler_cuda.py train small --steps 30 --eval-every 1000 --save-every 1000 --out "$W/one"
t train_gpus1.log python nanoeuler_cuda.py train small --steps 30 --eval-every 1000 --save-every 1000 --gpus 1 \
  --out "$W/gpus1"
for log in train.log train_gpus1.log; do grep -E "^step +30/" "$R/$log" | sed "s/^/$log: /" | tee -a "$S"; done
losses() { grep -E "^step " "$R/$1" | awk -F'|' '{print $1, $2, $4}'; }     # step, loss, norm
if [ -n "$(losses train.log)" ] && [ "$(losses train.log)" = "$(losses train_gpus1.log)" ]; then
  echo "losses: --gpus 1 == one GPU, every step" | tee -a "$S"
else
  echo "losses: --gpus 1 DIFFERS from one GPU (or no step lines)" | tee -a "$S"
fi
t sample.log python nanoeuler_cuda.py sample --model "$W/one/best.safetensors" --prompt "ROMEO:" \
  --max-new-tokens 40 --temperature 0
head -c 400 "$R/sample.log" | tee -a "$S"; echo | tee -a "$S"
t bench.log python nanoeuler_cuda.py bench small --steps 5 --max-new-tokens 50
grep -hE "tok/s|MFU" "$R/bench.log" | head -8 | tee -a "$S"
# decoding of big on random weights, as dev/logs/gpu_next_h200.log measured it before DECODE_PREFETCH left the
# code (plain KV cache 3,300 tok/s with PDL there): the default kernels should be no slower
t decode.log python nanoeuler_cuda.py bench big --decode-only
grep -hE "plain KV cache|1 draft" "$R/decode.log" | head -4 | tee -a "$S"
rm -rf "$W"
