#!/bin/bash
# NanoEuler's CPU training step against PyTorch eager's over thread counts (issue 39; docs/cpu_threads.md):
# bash dev/gpu/cpu_scaling.sh OUTDIR. tools/cpu_scaling.py on all the host's cores (threads 1, 2, 4, 8, 16
# at batch 8 and 32, two rounds), then pinned to 2 cores with taskset -c 0,1 (threads 1, 2, 16: asking for
# more threads than cores must not be slower), each under timeout 200 s; then NanoEuler's variants at 16
# threads, one round (MIN_ROWS 1, the rule before issue 39, 2 and 8; 2 and 8 BLAS threads a caller), under
# timeout 120 s. About 5 minutes in all on the H200 host. OUTDIR: summary.log (the tables),
# cpu_scaling_all.log, cpu_scaling_2cores.log, cpu_scaling_variants.log.
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
t cpu_scaling_variants.log timeout 120 python tools/cpu_scaling.py --no-torch --threads 16 --rounds 1 --min-rows 1,2,8 \
  --blas 2,8 --timeout 40
for log in cpu_scaling_all.log cpu_scaling_2cores.log cpu_scaling_variants.log; do
  # the tables, or where the timeout came first, the figures measured until then
  { echo "== $log"; if grep -q '^| batch' "$R/$log"; then sed -n '1p;/^| batch/,$p' "$R/$log";
    else sed -n '1p;/^round/p' "$R/$log"; fi; } | tee -a "$S"
done
