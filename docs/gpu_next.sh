#!/bin/bash
# One device run for the merged branch (issue 13's training step: bf16 activations as floatX,
# fused norms, one CUDA graph a step; issue 11's decoding: split-K attention, matvec splits),
# from the repository root, in ONE device command (timeout_s 600):
#     bash docs/gpu_next.sh          ($OUT: where summary.log, check.log and logs.tar.gz go)
# Steps in order of what matters most; each runs only if its expected time still fits under
# LIMIT (SECONDS since the start) and is cut there, so the whole ends before 9.5 minutes:
#   check (whole); bench big at batch 16 (one graph a step), 16 --no-graph, 64; bench big
#   --decode-only --profile --decode-variants; PyTorch (if installed on the device: it cannot
#   be installed, nothing outside is reachable) compiled with reduce-overhead, training at batch
#   16 and decoding; the GPU test (training resumes bit for bit); with time left bench --profile
#   at batch 16, batch 64 --no-graph, PyTorch's eager decoding, the CPU-side CUDA tests.
# On failure: if check fails, each of its parts runs on its own (docs/gpu_check_parts.py: one
# process a part, so a fault hides no other part) and a failed part again with its fallback
# switch (BF16_ACTIVATIONS, GRAPH_STEP, DECODE_ATTENTION = 'single'); a switch that mends a part
# is then used by the benches. A bench that fails runs again with the fallbacks.
# The summary at the end (and in $OUT/summary.log) is labelled line by line.
# A second command for what does not fit: bash docs/gpu_next.sh more (train big 60 steps, its
# loss against the earlier run's; 600 steps and decoding on the trained model, where drafts are
# right; PyTorch at batch 64 and compiled without graphs; --gpus 1 through NCCL == one GPU).
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}
G=/tmp/gpu_next                            # every log; tarred into $OUT at the end (8 files come back)
LIMIT=${LIMIT:-550}                       # seconds; the device tool stops a command at 600
mkdir -p $O $G
S=$O/summary.log
K=$G/key.log                               # the lines the summary repeats at the end
: > $S; : > $K
SW=""                                      # nanoeuler_cuda switches the benches run with (fallbacks)
key() { tee -a $S $K; }
banner() { echo; echo "=== $* (at ${SECONDS} s)"; }

# step NAME NEED BUDGET LOG CMD...: CMD into $G/LOG if NEED seconds still fit under LIMIT, cut
# at min(BUDGET, what is left); its time and rc into the summary; returns CMD's rc (99: skipped)
step() {
  local name=$1 need=$2 budget=$3 log=$4
  shift 4
  if [ $((SECONDS + need)) -gt $LIMIT ]; then
    echo "SKIPPED (at ${SECONDS} s, needs ~${need} s): $name" | key
    return 99
  fi
  [ $((LIMIT - SECONDS)) -lt $budget ] && budget=$((LIMIT - SECONDS))
  banner "$name" | tee -a $S
  local s=$EPOCHREALTIME
  timeout $budget "$@" < /dev/null > $G/$log 2>&1
  local rc=$?
  local note=""
  [ $rc -eq 124 ] && note=" TIMED OUT after ${budget} s"
  echo "[timing] $name: $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s, rc $rc$note" | key
  return $rc
}
# nanoeuler_cuda.py's command line, with the switches in $SW (an argument list for step: timeout runs it)
nc() { NC=(python -c "import sys, nanoeuler_cuda as nc$SW; nc.main(sys.argv[1:])"); }

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1; } | key

gpus1() {        # train 20 steps on one GPU and through NCCL with one rank: the same losses
  run() { python nanoeuler_cuda.py train big --steps 20 --batch 8 --eval-batches 1 --warmup 5 --precision fp32 "$@"; }
  rm -rf /tmp/one /tmp/rank1
  run --out /tmp/one && run --out /tmp/rank1 --gpus 1 && python - <<'EOF'
import numpy as np
a, b = (np.loadtxt(f"/tmp/{d}/log.csv", delimiter=",", skiprows=1, usecols=1) for d in ("one", "rank1"))
print("--gpus 1 == one GPU:", len(a) == 20 and np.array_equal(a, b), a[-1], b[-1])
EOF
}
export -f gpus1

more() {
  step "train big --steps 60 (before: val loss 5.5744, 2.394 bpb at step 60; docs/gpu_merged_h200.log)" 40 150 \
    train60.log python nanoeuler_cuda.py train big --steps 60 --eval-every 30 --out /tmp/tb
  grep -E "^val|^done|^step +(1|30|60)/|error" $G/train60.log | sed 's/^/train big 60: /' | key
  step "train big 600 steps (before: 52 s; docs/gpu_flow_h200.log)" 70 150 train600.log \
    python nanoeuler_cuda.py train big --steps 600 --out out/big
  grep -E "^done|^val|error" $G/train600.log | tail -3 | sed 's/^/train big 600: /' | key
  if [ -f out/big/best.safetensors ]; then
    step "bench --decode-only --decode-variants on the trained model" 40 100 bench_decode_trained.log \
      python nanoeuler_cuda.py bench --decode-only --decode-variants --model out/big/best.safetensors
    grep -E "tok/s|same tokens" $G/bench_decode_trained.log | sed "s|^ *|decode, trained: |" | key
  fi
  if python -c "import torch" 2>/dev/null; then
    step "PyTorch training, reduce-overhead, batch 64" 100 180 torch_b64.log \
      python docs/pytorch_reference.py --compile reduce-overhead --batch 64
    grep -E "^PyTorch" $G/torch_b64.log | tail -1 | key
    step "PyTorch training, torch.compile (no CUDA graphs), batch 16" 90 150 torch_b16_default.log \
      python docs/pytorch_reference.py --compile --batch 16
    grep -E "^PyTorch" $G/torch_b16_default.log | tail -1 | key
  fi
  step "--gpus 1 through NCCL against one GPU, fp32, 20 steps: equal losses" 60 120 gpus1.log bash -c gpus1
  grep -E "^--gpus 1|Error|error" $G/gpus1.log | tail -2 | key
}

main() {
  # ---------------------------------------------------------------- check
  step "check" 90 200 check.log python nanoeuler_cuda.py check
  check_rc=$?
  cp $G/check.log $O/check.log 2>/dev/null
  echo "check: rc $check_rc, $(grep -c ' OK$' $G/check.log) OK lines, $(grep -c 'NOT OK' $G/check.log) NOT OK" | key
  grep -E "NOT OK|overall|Error|error|failed" $G/check.log | head -30 | sed 's/^/check: /' | key
  if [ $check_rc -ne 0 ]; then
    tail -15 $G/check.log | tee -a $S
    # the parts with NOT OK lines, or all of them if check raised; each on its own, then a failed
    # one with its fallback switch
    python docs/gpu_check_parts.py --failed $G/check.log > $G/parts.txt 2>&1 || echo "kernels fp32" > $G/parts.txt
    echo "check parts to run on their own: $(paste -sd, $G/parts.txt)" | key
    while read -r part; do
      log="part_${part// /_}.log"
      step "check part: $part" 15 60 "$log" python docs/gpu_check_parts.py "$part"
      rc=$?
      [ $rc -eq 99 ] && break
      if grep -q "^PART" $G/$log; then grep "^PART" $G/$log | key; else echo "PART $part: rc $rc, no verdict" | key; fi
      [ $rc -eq 0 ] && continue
      # the benches take a fallback that mends a part of the big model's path (D = 64: model,
      # step); attention bf16 (D = 16, 32, 64) and sft bf16 (D = 32) only say whether it mends
      apply=yes
      case "$part" in
        "kernels bf16") SW="$SW; nc.BF16_ACTIVATIONS = False"        # the float build's kernels instead
                        echo "FALLBACK BF16_ACTIVATIONS=False for the benches (kernels.cu's bf16 build failed)" | key
                        fixes="" ;;
        "attention bf16"|"sft bf16") fixes="BF16_ACTIVATIONS=False"; apply=no ;;
        "model bf16") fixes="BF16_ACTIVATIONS=False" ;;
        "step fp32") fixes="GRAPH_STEP=False" ;;
        "step bf16") fixes="GRAPH_STEP=False BF16_ACTIVATIONS=False" ;;
        decoding*) fixes="DECODE_ATTENTION='single'" ;;
        *) fixes="" ;;
      esac
      for fix in $fixes; do
        flog="${log%.log}_${fix%%=*}.log"
        step "check part: $part with $fix" 15 60 "$flog" python docs/gpu_check_parts.py "$part" "$fix"
        if [ $? -eq 0 ] && [ $apply = yes ]; then
          echo "FALLBACK $fix mends '$part': the benches below run with it" | key
          case "$SW" in *"${fix%%=*}"*) ;; *) SW="$SW; nc.${fix}" ;; esac
        fi
        grep "^PART" $G/$flog | key
      done
    done < $G/parts.txt
    [ -n "$SW" ] && echo "FALLBACK: the benches run with${SW#;}" | key
  fi

  # ---------------------------------------------------------------- training speed
  bench_train() {   # bench_train NAME LOG FLAGS...: and once more with the fallbacks if it fails
    local name=$1 log=$2
    shift 2
    nc
    step "bench big $name" 25 100 $log "${NC[@]}" bench big --no-decode "$@"
    local rc=$?
    grep -E "ms/step|activations|Error|error" $G/$log | sed "s|^ *|bench $name: |" | key
    if [ $rc -ne 0 ] && [ $rc -ne 99 ]; then
      tail -5 $G/$log | tee -a $S
      SW_SAVED=$SW
      SW="$SW; nc.GRAPH_STEP = False; nc.BF16_ACTIVATIONS = False"
      nc
      step "bench big $name, fallback GRAPH_STEP and BF16_ACTIVATIONS off" 25 100 ${log%.log}_fallback.log \
        "${NC[@]}" bench big --no-decode "$@"
      grep -E "ms/step|activations|Error|error" $G/${log%.log}_fallback.log | sed "s|^ *|FALLBACK bench $name: |" | key
      SW=$SW_SAVED
    fi
  }
  bench_train "--batch 16 (one graph a step)" bench_b16.log --batch 16
  bench_train "--batch 16 --no-graph" bench_b16_nograph.log --batch 16 --no-graph
  bench_train "--batch 64" bench_b64.log --batch 64

  # ---------------------------------------------------------------- decoding speed
  nc
  step "bench big --decode-only --profile --decode-variants" 60 150 bench_decode.log \
    "${NC[@]}" bench big --decode-only --profile --decode-variants
  rc=$?
  cat $G/bench_decode.log >> $S
  grep -E "^decoding|tok/s|same tokens|us of GPU|prefill|Error|error" $G/bench_decode.log | sed "s|^ *|decode: |" | key
  if [ $rc -ne 0 ] && [ $rc -ne 99 ]; then
    SW_SAVED=$SW
    SW="$SW; nc.DECODE_ATTENTION = 'single'"
    nc
    step "bench big --decode-only, fallback DECODE_ATTENTION = 'single'" 40 100 bench_decode_single.log \
      "${NC[@]}" bench big --decode-only --profile
    grep -E "tok/s|Error|error" $G/bench_decode_single.log | sed "s|^ *|FALLBACK decode, single attention: |" | key
    SW=$SW_SAVED
  fi

  # ---------------------------------------------------------------- PyTorch, same machine, same minutes
  if python -c "import torch" 2>/dev/null; then
    step "PyTorch training, torch.compile reduce-overhead (CUDA graphs), batch 16" 130 200 torch_b16.log \
      python docs/pytorch_reference.py --compile reduce-overhead --batch 16
    grep -E "^PyTorch|Error|error" $G/torch_b16.log | tail -3 | key
    step "PyTorch decoding, compiled (reduce-overhead: CUDA graphs)" 45 120 torch_decode.log \
      python docs/pytorch_reference.py --decode --compile
    grep -E "^PyTorch|Error|error" $G/torch_decode.log | tail -3 | key
  else
    echo "PyTorch: not installed on this machine, no PyTorch figures in this run" | key
  fi

  # ---------------------------------------------------------------- GPU test
  step "GPU test: training resumes bit for bit (test_nanoeuler.py)" 50 150 test_resume.log \
    python -m pytest -q -p no:cacheprovider test_nanoeuler.py -k "resumes_bit"
  tail -1 $G/test_resume.log | sed 's/^/GPU test: /' | key

  # ---------------------------------------------------------------- with time left
  nc
  step "bench big --batch 16 --profile" 40 90 bench_b16_profile.log "${NC[@]}" bench big --no-decode --batch 16 --profile
  sed -n '/by family/,/and by kernel/p' $G/bench_b16_profile.log | tee -a $S
  grep -E "ms/step|GPU time" $G/bench_b16_profile.log | sed "s|^ *|bench --batch 16 --profile: |" | key
  bench_train "--batch 64 --no-graph" bench_b64_nograph.log --batch 64 --no-graph
  if python -c "import torch" 2>/dev/null; then
    step "PyTorch decoding, eager" 30 60 torch_decode_eager.log python docs/pytorch_reference.py --decode
    grep -E "^PyTorch" $G/torch_decode_eager.log | tail -1 | key
  fi
  step "CPU-side CUDA tests (test_cuda_pipeline.py, not the emulator's)" 40 90 test_pipeline.log \
    python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py -k "not emulator"
  tail -1 $G/test_pipeline.log | sed 's/^/CPU-side tests: /' | key
}

if [ "$1" = more ]; then more; else main; fi

# ---------------------------------------------------------------- summary
tar -czf $O/logs.tar.gz -C $G . 2>/dev/null
{
  echo
  echo "==================== SUMMARY (docs/gpu_next.sh $*, ${SECONDS} s; every log in logs.tar.gz) ===================="
  cat $K
  echo "==================== END OF SUMMARY ===================="
} | tee -a $S
