#!/bin/bash
# Two "hosts" on one machine with two GPUs (issue 37, docs/multinode.md): bash dev/gpu/multinode_two_nodes.sh
# OUTDIR. Not yet run: no machine with two GPUs was at hand. Each "host" sees one GPU
# (CUDA_VISIBLE_DEVICES) and its own --out (no shared folder), and NCCL is kept off NVLink and shared
# memory (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo: sockets, as between hosts).
# Train small for 40 steps three ways: --gpus 2 (one host), the program's own launcher twice
# (--nnodes 2 --gpus 1), and two ranks with torchrun's variables; their log.csv losses must be equal
# (two ranks' sums a + b are the same bits in any order). Then 20 steps and --resume to 40 with
# --nnodes 2, host 1's folder emptied in between (rank 0 hands on its checkpoint), against the straight
# run. About two minutes on two H200s. The summary: OUTDIR/summary.log; the runs' output in OUTDIR/logs.
source "$(dirname "$0")/common.sh"
L=$R/logs; mkdir -p "$L"
O=$(mktemp -d)/out
F="small --steps 40 --eval-every 20 --save-every 20 --batch 16"
SOCKETS="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo"
two_hosts() {   # two_hosts NAME ENV0 ENV1 FLAGS0 FLAGS1 [FLAGS...]: host 1 in the background, then host 0
  local name=$1 env0=$2 env1=$3 flags0=$4 flags1=$5; shift 5
  env $SOCKETS CUDA_VISIBLE_DEVICES=1 $env1 python nanoeuler_cuda.py train $F $flags1 --out $O/${name}_host1 "$@" \
    > "$R/${name}_host1.log" 2>&1 &
  local host1=$!
  t ${name}_host0.log env $SOCKETS CUDA_VISIBLE_DEVICES=0 $env0 python nanoeuler_cuda.py train $F $flags0 \
    --out $O/${name}_host0 "$@"
  wait $host1; echo "[host 1] $name: exit code $?" | tee -a "$S"
}
NODES="--nnodes 2 --master-addr 127.0.0.1 --master-port 29560 --gpus 1"
t gpus2.log python nanoeuler_cuda.py train $F --gpus 2 --out $O/gpus2
two_hosts nnodes "" "" "$NODES --node-rank 0" "$NODES --node-rank 1"
two_hosts torchrun "RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561" \
  "RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561" "" ""
# resumed with --nnodes 2, host 1's folder emptied between the two halves
two_hosts resumed "" "" "$NODES --node-rank 0" "$NODES --node-rank 1" --stop-after 20
mv "$R/resumed_host0.log" "$R/resumed_a_host0.log"; mv "$R/resumed_host1.log" "$R/resumed_a_host1.log"
rm -rf $O/resumed_host1
two_hosts resumed "" "" "$NODES --node-rank 0" "$NODES --node-rank 1" --resume
python - "$O" <<'EOF' 2>&1 | tee -a "$S"
import os, sys
out = sys.argv[1]
def losses(run):
    path = os.path.join(out, run, "log.csv")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return [ln.split(",")[1] for ln in f.read().splitlines()[1:]]
ref = losses("gpus2") or []
print(f"--gpus 2: {len(ref)} steps, last loss {ref[-1] if ref else '?'}")
for run in ("nnodes_host0", "torchrun_host0", "resumed_host0"):
    got = losses(run)
    if got is None:
        print(f"{run}: no log.csv (see its log in logs/)")
        continue
    print(f"{run}: " + ("the same losses as --gpus 2" if got == ref else
                        f"differs from --gpus 2 at step {next((i + 1 for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(got))}"))
print("host 1's folders hold:", {run: sorted(os.listdir(os.path.join(out, run))) if os.path.isdir(os.path.join(out, run))
                                  else None for run in ("nnodes_host1", "resumed_host1")})
EOF
for f in "$R"/*.log; do [ "$f" = "$S" ] || mv "$f" "$L/"; done
rm -rf "$(dirname "$O")"
