#!/bin/bash
# A session's last device call when little device time is left (bash dev/gpu/session_end_short.sh OUTDIR),
# about 5.5 minutes on one H100 or H200: check; bench big at batch 64 and 16, PyTorch's best at 64; the
# README's GPU flow (train big --mtp-weight 1.5, sft, chat greedy and --speculative, decoding speed on the
# SFT model); decoding on random weights; the GPU tests (100 s at most).
# OUTDIR: summary.log (every part's summary) and logs.tgz.
source "$(dirname "$0")/common.sh"
L=$R/logs; mkdir -p "$L"
run_check && mv "$R/check.log" "$L/"
for b in 64 16; do
  python nanoeuler_cuda.py bench big --batch $b --no-decode > "$L/bench_b$b.log" 2>&1
  echo "bench b$b: $(grep -E 'ms/step|rror' "$L/bench_b$b.log" | tail -1)" | tee -a "$S"
done
t torch_b64.log timeout 100 python tools/pytorch_reference.py --compile reduce-overhead --batch 64
grep -E "^PyTorch|Error" "$R/torch_b64.log" | tail -1 | tee -a "$S"; mv "$R/torch_b64.log" "$L/"
readme_flow
t decode_random.log timeout 60 python nanoeuler_cuda.py bench --decode-only
grep -hE "tok/s|prefill" "$R/decode_random.log" | tee -a "$S"; mv "$R/decode_random.log" "$L/"
t pytest_gpu.log timeout 100 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py test_async_save.py -k "not emulator"
tail -3 "$R/pytest_gpu.log" | tee -a "$S"; mv "$R/pytest_gpu.log" "$L/"
(cd "$R" && tar -czf logs.tgz logs && rm -rf logs)
