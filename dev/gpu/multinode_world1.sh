#!/bin/bash
# Beyond one host, on one GPU (issue 37, docs/multinode.md): bash dev/gpu/multinode_world1.sh OUTDIR.
# A world of one started through each launcher's variables (torchrun's, srun's, mpirun's; the real
# torchrun and mpirun too where installed) trains small for 60 steps; its weights must equal --gpus 1's
# bit for bit (the same data-parallel engine), and are compared with the plain run's (GPUEngine, the
# step as one CUDA graph). Then: 30 steps and --resume to 60 under torchrun's variables (rank 0's start
# broadcast, its data order shared) against the straight run; bench under srun's; a rank whose rank 0
# never comes. About a minute on an H200; no network. The summary: OUTDIR/summary.log; logs in OUTDIR/logs.
source "$(dirname "$0")/common.sh"
L=$R/logs; mkdir -p "$L"
O=$(mktemp -d)/out                          # the runs (and their shared token cache beside them)
F="small --steps 60 --eval-every 30 --save-every 30"
TORCHRUN_VARS="RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555"
SRUN_VARS="SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=1 SLURM_LOCALID=0 SLURM_STEP_NODELIST=localhost"
MPI_VARS="OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=1 OMPI_COMM_WORLD_LOCAL_RANK=0"
runs="plain gpus1"
t plain.log python nanoeuler_cuda.py train $F --out $O/plain
t gpus1.log python nanoeuler_cuda.py train $F --gpus 1 --out $O/gpus1
t torchrun_vars.log env $TORCHRUN_VARS python nanoeuler_cuda.py train $F --out $O/torchrun_vars
t srun_vars.log env $SRUN_VARS python nanoeuler_cuda.py train $F --out $O/srun_vars
t mpirun_vars.log env $MPI_VARS python nanoeuler_cuda.py train $F --out $O/mpirun_vars
runs="$runs torchrun_vars srun_vars mpirun_vars"
if command -v torchrun > /dev/null; then
  t torchrun.log torchrun --nnodes 1 --nproc-per-node 1 --master-port 29556 nanoeuler_cuda.py train $F --out $O/torchrun
  runs="$runs torchrun"
else echo "torchrun: not installed here, its variables only" | tee -a "$S"; fi
if command -v mpirun > /dev/null; then
  t mpirun.log mpirun --allow-run-as-root -n 1 python nanoeuler_cuda.py train $F --out $O/mpirun
  runs="$runs mpirun"
else echo "mpirun: not installed here, its variables only" | tee -a "$S"; fi
# stopped at 30 and resumed to 60 under torchrun's variables: rank 0 reads the checkpoint and hands it on
t resume_a.log env $TORCHRUN_VARS python nanoeuler_cuda.py train $F --stop-after 30 --out $O/resumed
t resume_b.log env $TORCHRUN_VARS python nanoeuler_cuda.py train $F --resume --out $O/resumed
runs="$runs resumed"
grep -h "^device\|^resuming" "$R"/plain.log "$R"/torchrun_vars.log "$R"/resume_b.log | tee -a "$S"
python - "$O" $runs <<'EOF' 2>&1 | tee -a "$S"
import os, sys
import numpy as np
import nanoeuler as ne
out, runs = sys.argv[1], sys.argv[2:]
def weights(run):
    path = os.path.join(out, run, "model_000060.safetensors")
    if not os.path.exists(path):
        return None
    return ne.read_safetensors(path)[0]
def losses(run):
    with open(os.path.join(out, run, "log.csv")) as f:
        return [ln.split(",")[1] for ln in f.read().splitlines()[1:]]
base = {"gpus1": weights("gpus1"), "plain": weights("plain")}
for run in runs:
    w = weights(run)
    if w is None:
        print(f"{run:14s} no model_000060.safetensors (see logs/{run}.log)")
        continue
    said = []
    for ref in ("gpus1", "plain"):
        if run == ref or base[ref] is None:
            continue
        worst = max(float(np.max(np.abs(w[k].astype(np.float64) - base[ref][k]))) for k in w)
        same = all(np.array_equal(w[k], base[ref][k]) for k in w) and w.keys() == base[ref].keys()
        said.append(f"vs {ref}: " + ("identical weights" if same else f"max |diff| {worst:.3g}"))
    print(f"{run:14s} final loss {losses(run)[-1]}, " + "; ".join(said))
EOF
# bench under srun's variables (a world of one through NCCL)
t bench_srun_vars.log env $SRUN_VARS python nanoeuler_cuda.py bench small --steps 5 --no-decode
grep -h "ms/step\|x 1," "$R/bench_srun_vars.log" | tee -a "$S"
# rank 1 of 2 whose rank 0 never comes: one sentence, exit 2, within the timeout
t never.log env RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29557 \
  python nanoeuler_cuda.py train $F --rendezvous-timeout 5 --out $O/never
tail -1 "$R/never.log" | tee -a "$S"
mv "$R"/*.log "$L"/ 2>/dev/null; mv "$L/summary.log" "$R/"
rm -rf "$(dirname "$O")"
