#!/bin/bash
# NanoEuler's CPU training step against PyTorch eager's over thread counts (issue 39; docs/cpu_threads.md):
# bash dev/gpu/cpu_scaling.sh OUTDIR. About 4 minutes on the H200 host, in one device call. tools/cpu_scaling.py
# on all the host's cores at threads 2, 4, 8, 16 and batch 8 and 32, two rounds, beside PyTorch and three
# variants: MIN_ROWS=1 (--threads is the workers' count, up to a row each), the same on threads instead of
# processes (the GIL's cost), and with 2 BLAS threads a worker; then threads 1 (one round), then pinned to 2
# cores with taskset -c 0,1 (threads 1, 2; processes against threads). OUTDIR: summary.log (the tables),
# cpu_scaling_all.log, cpu_scaling_one.log, cpu_scaling_2cores.log.
# Without PyTorch on the machine it runs NanoEuler's side only and says so. The 2026-12-04 evening run
# (dev/logs/2026-12-04_cpu39) was of a tree with dev/variants/cpu39_step_processes.diff applied: there
# STEP_PROCESSES=False is the threads; on main every variant runs threads (MAX_THREADS caps them at 8).
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
t cpu_scaling_all.log timeout 200 python tools/cpu_scaling.py --threads 2,4,8,16 --steps 5 --timeout 40 "${flags[@]}" \
  --variant MIN_ROWS=1 --variant "MIN_ROWS=1 STEP_PROCESSES=False" --variant "MIN_ROWS=1 OPENBLAS_NUM_THREADS=2"
t cpu_scaling_one.log timeout 40 python tools/cpu_scaling.py --threads 1 --rounds 1 --steps 4 "${flags[@]}"
t cpu_scaling_2cores.log timeout 60 taskset -c 0,1 python tools/cpu_scaling.py --threads 1,2 --rounds 1 --steps 4 \
  --variant STEP_PROCESSES=False "${flags[@]}"
for log in cpu_scaling_all.log cpu_scaling_one.log cpu_scaling_2cores.log; do
  # the tables, or where the timeout came first, the figures measured until then
  { echo "== $log"; if grep -q '^| batch' "$R/$log"; then sed -n '1p;/^| batch/,$p' "$R/$log";
    else sed -n '1p;/^round/p' "$R/$log"; fi; } | tee -a "$S"
done
