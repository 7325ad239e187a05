#!/bin/bash
# Beyond one host, on one GPU (issue 37, docs/multinode.md): bash dev/gpu/multinode_world1.sh OUTDIR.
# A world of one started through each launcher's variables (torchrun's, srun's, mpirun's; the real
# torchrun and mpirun too where installed) trains small for 40 steps in fp32; its final weights must
# equal the plain run's and --gpus 1's bit for bit (as test_nanoeuler.py pins --gpus 1 in fp32). In bf16,
# torchrun's variables against --gpus 1 (the same data-parallel engine: identical) and the plain run
# (the step as one CUDA graph: said, not required). Then: 20 steps and --resume to 40 under torchrun's
# variables (rank 0's start broadcast, its data order shared) against the straight run; bench under
# srun's; a rank whose rank 0 never comes. About a minute on an H200; no network.
# The summary: OUTDIR/summary.log; every run's output in OUTDIR/logs.
source "$(dirname "$0")/common.sh"
L=$R/logs; mkdir -p "$L"
O=$(mktemp -d)/out                          # the runs (and their shared token cache beside them)
F="small --steps 40 --eval-every 20 --save-every 20"
TORCHRUN_VARS="RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555"
SRUN_VARS="SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=1 SLURM_LOCALID=0 SLURM_STEP_NODELIST=localhost"
MPI_VARS="OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=1 OMPI_COMM_WORLD_LOCAL_RANK=0"
train() {   # train NAME PRECISION [ENV=VALUE...] [-- FLAGS...]: train $F into $O/NAME, its output in NAME.log
  local name=$1 precision=$2; shift 2
  local env=() flags=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do env+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift && flags=("$@")
  t $name.log env "${env[@]}" python nanoeuler_cuda.py train $F --precision $precision --out $O/$name "${flags[@]}"
}
train plain fp32
train gpus1 fp32 -- --gpus 1
train torchrun_vars fp32 $TORCHRUN_VARS
train srun_vars fp32 $SRUN_VARS
train mpirun_vars fp32 $MPI_VARS
fp32="plain gpus1 torchrun_vars srun_vars mpirun_vars"
if command -v torchrun > /dev/null; then
  t torchrun.log torchrun --nnodes 1 --nproc-per-node 1 --master-port 29556 nanoeuler_cuda.py train $F \
    --precision fp32 --out $O/torchrun
  fp32="$fp32 torchrun"
else echo "torchrun: not installed here, its variables only" | tee -a "$S"; fi
if command -v mpirun > /dev/null; then
  t mpirun.log mpirun --allow-run-as-root -n 1 python nanoeuler_cuda.py train $F --precision fp32 --out $O/mpirun
  fp32="$fp32 mpirun"
else echo "mpirun: not installed here, its variables only" | tee -a "$S"; fi
train resumed fp32 $TORCHRUN_VARS -- --stop-after 20     # stopped at 20, resumed to 40: rank 0 reads the
mv "$R/resumed.log" "$R/resumed_a.log"                   # checkpoint and hands it on
train resumed fp32 $TORCHRUN_VARS -- --resume
mv "$R/resumed.log" "$R/resumed_b.log"
fp32="$fp32 resumed"
train plain_bf16 bf16
train gpus1_bf16 bf16 -- --gpus 1
train torchrun_vars_bf16 bf16 $TORCHRUN_VARS
grep -h "^device\|^resuming" "$R"/plain.log "$R"/torchrun_vars.log "$R"/resumed_b.log | tee -a "$S"
python - "$O" plain gpus1 $fp32 -- gpus1_bf16 plain_bf16 gpus1_bf16 torchrun_vars_bf16 <<'EOF' 2>&1 | tee -a "$S"
# groups (split by --): two references, then the runs; each run's final weights against each reference
import os, sys
import numpy as np
import nanoeuler as ne
out = sys.argv[1]
def weights(run):
    path = os.path.join(out, run, "model_000040.safetensors")
    return ne.read_safetensors(path)[0] if os.path.exists(path) else None
def last_loss(run):
    with open(os.path.join(out, run, "log.csv")) as f:
        return f.read().splitlines()[-1].split(",")[1]
for group in " ".join(sys.argv[2:]).split(" -- "):
    refs, runs = group.split()[:2], dict.fromkeys(group.split()[2:])
    base = {ref: weights(ref) for ref in refs}
    for run in runs:
        w = weights(run)
        if w is None:
            print(f"{run:20s} no model_000040.safetensors (see its log in logs/)")
            continue
        said = []
        for ref in refs:
            if run == ref or base[ref] is None:
                continue
            same = w.keys() == base[ref].keys() and all(np.array_equal(w[k], base[ref][k]) for k in w)
            worst = max(float(np.max(np.abs(w[k].astype(np.float64) - base[ref][k]))) for k in w)
            said.append(f"vs {ref}: " + ("identical weights" if same else f"max |diff| {worst:.3g}"))
        print(f"{run:20s} final loss {last_loss(run)}, " + "; ".join(said))
EOF
# bench under srun's variables (a world of one through NCCL)
t bench_srun_vars.log env $SRUN_VARS python nanoeuler_cuda.py bench small --steps 5 --no-decode
grep -h "ms/step\|x 1," "$R/bench_srun_vars.log" | tee -a "$S"
# rank 1 of 2 whose rank 0 never comes: one sentence, exit 2, within the timeout
t never.log env RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29557 \
  python nanoeuler_cuda.py train $F --rendezvous-timeout 5 --out $O/never
tail -1 "$R/never.log" | tee -a "$S"
for f in "$R"/*.log; do [ "$f" = "$S" ] || mv "$f" "$L/"; done
rm -rf "$(dirname "$O")"
