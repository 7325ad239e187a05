#!/bin/bash
# The closing device run of a host-side change (bash docs/gpu_host_recheck.sh; $OUT: summary.log,
# the chat transcripts and logs.tgz), about 4 minutes on an H200: check; the README's flow (train
# big, sft, chat greedy and --speculative, decoding speed on that SFT model); bench's flags refused
# before a GPU starts; a --gpus 1 run whose launcher is killed; the GPU tests of test_nanoeuler.py;
# test_cuda_pipeline.py.
source "$(dirname "$0")/gpu_common.sh"
L=$R/logs; mkdir -p "$L"
run_check && mv "$R/check.log" "$L/"
readme_flow
# --gpus 1 with its launcher killed (kill -9) mid-run: rank 0 must save and stop on its own
python nanoeuler_cuda.py train small --gpus 1 --steps 100000 --eval-every 100000 --save-every 100000 \
  --out out/kill > "$R/kill.log" 2>&1 &
launcher=$!
for i in $(seq 600); do grep -qE "^step +100/" "$R/kill.log" && break; sleep 0.1; done
rank0=$(pgrep -f -n "nanoeuler_cuda.py train small --gpus 1")
kill -9 $launcher; echo "launcher $launcher killed at: $(grep -E '^step' "$R/kill.log" | tail -1 | cut -c1-40)" | tee -a "$S"
python nanoeuler_cuda.py train small --steps 2 --resume --out out/kill 2>&1 | tail -1 | sed "s/^/a second run at once: /" | tee -a "$S"
for i in $(seq 600); do kill -0 $rank0 2>/dev/null || break; sleep 0.1; done
kill -0 $rank0 2>/dev/null && echo "rank 0 ($rank0) still runs after 60 s" | tee -a "$S"
grep -E "SIGTERM|saved|error" "$R/kill.log" | tail -3 | sed "s/^/rank 0: /" | tee -a "$S"
echo "out/kill: $(ls out/kill | tr '\n' ' ')" | tee -a "$S"
mv "$R/kill.log" "$L/"
for flags in "huge" "--decode-precision fp8" "--decode-only --no-decode"; do
  python nanoeuler_cuda.py bench $flags 2>&1 | tail -1 | sed "s/^/bench $flags: /" | tee -a "$S"
done
t pytest_gpu.log python -m pytest -q -p no:cacheprovider test_nanoeuler.py -k "gpu or GPU or data_parallel or launcher"
tail -2 "$R/pytest_gpu.log" | tee -a "$S"; mv "$R/pytest_gpu.log" "$L/"
# the CPU emulator's tests on this machine's Ubuntu toolchain (its fortified g++ aborted them before 2026-12-03)
t pytest_pipeline.log timeout 420 python -m pytest -q -p no:cacheprovider -x test_cuda_pipeline.py
tail -2 "$R/pytest_pipeline.log" | tee -a "$S"; mv "$R/pytest_pipeline.log" "$L/"
(cd "$R" && tar -czf logs.tgz logs && rm -rf logs)
