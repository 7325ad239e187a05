#!/bin/bash
# The closing device run of a host-side change (bash dev/gpu/host_recheck.sh OUTDIR; OUTDIR: summary.log,
# the chat transcripts and logs.tgz), about 4 minutes on an H200: check; the README's flow (train
# big, sft, chat greedy and --speculative, decoding speed on that SFT model); bench's flags refused
# before a GPU starts; a --gpus 1 run whose launcher is killed; the GPU tests of test_nanoeuler.py;
# test_cuda_pipeline.py.
source "$(dirname "$0")/common.sh"
L=$R/logs; mkdir -p "$L"
run_check && mv "$R/check.log" "$L/"
readme_flow
launcher_kill
for flags in "huge" "--decode-precision fp8" "--decode-only --no-decode"; do
  python nanoeuler_cuda.py bench $flags 2>&1 | tail -1 | sed "s/^/bench $flags: /" | tee -a "$S"
done
t pytest_gpu.log python -m pytest -q -p no:cacheprovider test_nanoeuler.py -k "gpu or GPU or data_parallel or launcher"
tail -2 "$R/pytest_gpu.log" | tee -a "$S"; mv "$R/pytest_gpu.log" "$L/"
# the CPU emulator's tests on this machine's Ubuntu toolchain (its fortified g++ aborted them before 2026-12-03)
t pytest_pipeline.log timeout 420 python -m pytest -q -p no:cacheprovider -x test_cuda_pipeline.py
tail -2 "$R/pytest_pipeline.log" | tee -a "$S"; mv "$R/pytest_pipeline.log" "$L/"
(cd "$R" && tar -czf logs.tgz logs && rm -rf logs)
