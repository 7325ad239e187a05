#!/bin/bash
# NanoEuler's CPU training step against PyTorch eager's over thread counts (issue 39; docs/cpu_threads.md):
# bash dev/gpu/cpu_scaling.sh OUTDIR. About 4 minutes on the H200 host, in one device call: tools/cpu_scaling.py
# with the default rule (threads up to 4 workers, forked processes beyond) on all the host's cores at threads 1,
# 2, 4, 8, 16 and batch 8 and 32, two rounds, beside PyTorch; then the same step on threads only (PROCESSES_ABOVE=64)
# at 8 and 16, one round; then pinned to 2 cores with taskset -c 0,1 (threads 1, 2: the 2-core path, threads).
# OUTDIR: summary.log (the tables), cpu_scaling_all.log, cpu_scaling_threads.log, cpu_scaling_2cores.log.
# Without PyTorch on the machine it runs NanoEuler's side only and says so. The 2026-12-04 evening sweep that
# chose the rule (processes, threads, MIN_ROWS, 2 BLAS threads a worker) is in dev/logs/2026-12-04_cpu39.
source "$(dirname "$0")/common.sh"
echo "$(date -u '+%F %T UTC'), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)," \
  "$(lscpu | grep -E '^(Thread|Core)' | tr -s ' ' | tr '\n' ' ')" | tee -a "$S"
flags=()
if python -c "import torch" > "$R/torch_check.log" 2>&1; then
  echo "PyTorch $(python -c 'import torch; print(torch.__version__)') is importable: both sides run" | tee -a "$S"
else
  flags=(--no-torch)
  echo "PyTorch is not importable here ($(tail -1 "$R/torch_check.log")): NanoEuler's side only" | tee -a "$S"
fi
t cpu_scaling_all.log timeout 180 python tools/cpu_scaling.py --threads 1,2,4,8,16 --steps 5 --timeout 40 \
  "${flags[@]}"
t cpu_scaling_threads.log timeout 45 python tools/cpu_scaling.py --threads 8,16 --rounds 1 --steps 5 --no-torch \
  --variant PROCESSES_ABOVE=64
t cpu_scaling_2cores.log timeout 60 taskset -c 0,1 python tools/cpu_scaling.py --threads 1,2 --rounds 1 --steps 4 \
  "${flags[@]}"
for log in cpu_scaling_all.log cpu_scaling_threads.log cpu_scaling_2cores.log; do
  # the tables, or where the timeout came first, the figures measured until then
  { echo "== $log"; if grep -q '^| batch' "$R/$log"; then sed -n '1p;/^| batch/,$p' "$R/$log";
    else sed -n '1p;/^round/p' "$R/$log"; fi; } | tee -a "$S"
done
