#!/bin/bash
# Superseded by docs/gpu_next.sh (the merged branch: training and decoding in one device command).
# One device run for issue 13's training step (bf16 activations as floatX, fused norms, one CUDA
# graph a step), from the repository root: bash docs/gpu_train_next.sh ($OUT: where the logs go).
# In order of what matters most, each step under its own timeout, the optional ones only while
# the whole stays under 9 minutes (SECONDS):
#   check; bench big at batch 16 (graph, --no-graph, --profile); PyTorch compiled with CUDA graphs,
#   batch 16; the same at batch 64; the GPU tests; train big --steps 60 (loss against the earlier
#   run); then, with time left, PyTorch compiled without graphs and --gpus 1 through NCCL against
#   one GPU. If check fails, check again with the fallbacks (BF16_ACTIVATIONS, GRAPH_STEP off),
#   to say which part failed. The old code's step cannot run in this tree: its figures are in
#   docs/gpu_profile_h200.log (22.7 ms, 22.1 ms of GPU time, batch 16) and BENCHMARKS.md.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}
mkdir -p $O
t() { local s=$EPOCHREALTIME; "$@"; local rc=$?; echo "[timing] $* : $(awk "BEGIN{print $EPOCHREALTIME - $s}") s (rc $rc)"; return $rc; }
left() { [ $SECONDS -lt $1 ]; }            # still under $1 seconds since the start
banner() { echo; echo "=== $* (at ${SECONDS} s)"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/summary.log
git log --oneline -1 | tee -a $O/summary.log

banner check | tee -a $O/summary.log
t timeout 240 python nanoeuler_cuda.py check > $O/check.log 2>&1
rc=$?
grep -c " OK$" $O/check.log | sed 's/^/check OK lines: /' | tee -a $O/summary.log
grep "\[timing\]" $O/check.log | tee -a $O/summary.log
grep -E "NOT OK|overall|Error|error" $O/check.log | tee -a $O/summary.log
if [ $rc -ne 0 ]; then
  tail -30 $O/check.log
  for switch in BF16_ACTIVATIONS GRAPH_STEP; do          # which part fails: check with it off
    banner "check with $switch = False" | tee -a $O/summary.log
    timeout 150 python -c "import nanoeuler_cuda as nc; nc.$switch = False; nc.main(['check'])" > $O/check_no_$switch.log 2>&1
    grep -E "NOT OK|overall" $O/check_no_$switch.log | tee -a $O/summary.log
  done
fi

for B in 16 64; do
  for flags in "" "--no-graph" "--profile"; do
    banner "bench big --batch $B $flags" | tee -a $O/summary.log
    t timeout 120 python nanoeuler_cuda.py bench big --batch $B --no-decode $flags 2>&1 | tee $O/bench_b${B}${flags// /}.log | grep -v "^    " | tee -a $O/summary.log
    [ "$flags" = "--profile" ] && sed -n '/by family/,/and by kernel/p' $O/bench_b${B}${flags// /}.log | tee -a $O/summary.log
  done
  banner "PyTorch, torch.compile reduce-overhead (CUDA graphs), batch $B" | tee -a $O/summary.log
  if python -c "import torch" 2>/dev/null; then
    t timeout 200 python docs/pytorch_reference.py --compile reduce-overhead --batch $B 2>&1 | tail -3 | tee -a $O/summary.log
  else
    echo "torch is not installed here: no PyTorch figure in this run" | tee -a $O/summary.log
  fi
done

banner "GPU tests" | tee -a $O/summary.log
t timeout 240 python -m pytest -q test_cuda_pipeline.py test_gpu_host.py 2>&1 | tail -3 | tee -a $O/summary.log
t timeout 300 python -m pytest -q test_nanoeuler.py -k "resumes_bit or launched" 2>&1 | tail -3 | tee -a $O/summary.log

if left 420; then
  banner "train big --steps 60 (before: val loss 5.5744, 2.394 bpb at step 60, 23.0 ms/step; docs/gpu_merged_h200.log)" | tee -a $O/summary.log
  rm -rf /tmp/tb
  t timeout 150 python nanoeuler_cuda.py train big --steps 60 --eval-every 30 --out /tmp/tb 2>&1 | tee $O/train.log | grep -E "^val|^done|^step +(1|30|60)/" | tee -a $O/summary.log
fi
if left 440 && python -c "import torch" 2>/dev/null; then
  banner "PyTorch, torch.compile (no CUDA graphs), batch 16" | tee -a $O/summary.log
  t timeout 120 python docs/pytorch_reference.py --compile --batch 16 2>&1 | tail -3 | tee -a $O/summary.log
fi
if left 470; then
  banner "--gpus 1 through NCCL against one GPU, fp32, 20 steps: the losses must be equal" | tee -a $O/summary.log
  rm -rf /tmp/one /tmp/rank1
  run() { timeout 90 python nanoeuler_cuda.py train big --steps 20 --batch 8 --eval-batches 1 --warmup 5 --precision fp32 "$@" > /dev/null 2>&1; }
  run --out /tmp/one && run --out /tmp/rank1 --gpus 1 && \
    python -c "
import numpy as np
a, b = (np.loadtxt(f'/tmp/{d}/log.csv', delimiter=',', skiprows=1, usecols=1) for d in ('one', 'rank1'))
print('--gpus 1 == one GPU:', len(a) == 20 and np.array_equal(a, b), a[-1], b[-1])" | tee -a $O/summary.log
fi
banner "done" | tee -a $O/summary.log
