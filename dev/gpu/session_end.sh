#!/bin/bash
# A session's last device call (bash dev/gpu/session_end.sh OUTDIR), at most about 9 minutes on the H200
# machine: check; the README's GPU flow (train big, sft, chat greedy and --speculative, decoding speed);
# the GPU tests (test_cuda_pipeline.py, test_async_save.py without the emulator, 120 s at most); then
# dev/gpu/cpu_scaling.sh (the CPU step beside PyTorch over threads, about 4.5 minutes at most) into
# OUTDIR/cpu. OUTDIR: summary.log (every part's summary) and logs.tgz.
source "$(dirname "$0")/common.sh"
L=$R/logs; mkdir -p "$L"
run_check && mv "$R/check.log" "$L/"
readme_flow
t pytest_gpu.log timeout 120 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py test_async_save.py -k "not emulator"
tail -3 "$R/pytest_gpu.log" | tee -a "$S"; mv "$R/pytest_gpu.log" "$L/"
echo "== dev/gpu/cpu_scaling.sh" | tee -a "$S"
bash dev/gpu/cpu_scaling.sh "$R/cpu" > "$L/cpu_scaling.out" 2>&1
cat "$R/cpu/summary.log" >> "$S"; mv "$R/cpu" "$L/"
(cd "$R" && tar -czf logs.tgz logs && rm -rf logs)
