#!/bin/bash
# NanoEuler's CPU training step against PyTorch eager's over thread counts (issue 39; docs/cpu_threads.md):
# bash dev/gpu/cpu_scaling.sh OUTDIR. tools/cpu_scaling.py on all the host's cores (threads 1, 2, 4, 8, 16
# at batch 8 and 32, two rounds), then pinned to 2 cores with taskset -c 0,1 (threads 1, 2, 16: asking for
# more threads than cores must not be slower); each under timeout 200 s, about 5 minutes in all on the
# H200 host. OUTDIR: summary.log (the two tables), cpu_scaling_all.log, cpu_scaling_2cores.log.
# Without PyTorch on the machine it runs NanoEuler's side only and says so.
source "$(dirname "$0")/common.sh"
echo "$(date -u '+%F %T UTC'), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)" | tee -a "$S"
flags=()
if python -c "import torch" > "$R/torch_check.log" 2>&1; then
  echo "PyTorch $(python -c 'import torch; print(torch.__version__)') is importable: both sides run" | tee -a "$S"
else
  flags=(--no-torch)
  echo "PyTorch is not importable here ($(tail -1 "$R/torch_check.log")): NanoEuler's side only" | tee -a "$S"
fi
t cpu_scaling_all.log timeout 200 python tools/cpu_scaling.py "${flags[@]}"
t cpu_scaling_2cores.log timeout 200 taskset -c 0,1 python tools/cpu_scaling.py --threads 1,2,16 --steps 8 "${flags[@]}"
for log in cpu_scaling_all.log cpu_scaling_2cores.log; do
  { echo "== $log"; sed -n '1p;/^| batch/,$p' "$R/$log"; } | tee -a "$S"
done
