#!/bin/bash
# Superseded by docs/gpu_next.sh (the merged branch: training and decoding in one device command).
# One device run for issue 11's decoding speed (split-K attention, decode_matvec over every SM in
# one round of loads, argmax in one round; programmatic dependent launch behind DECODE_PDL, off),
# from the repository root: bash docs/gpu_decode_next.sh ($OUT: where the logs go). In order of
# what matters most, each step under its own timeout, the later ones only where their timeout
# still ends before 9 minutes (SECONDS; about 6 minutes expected):
#   check (the decode lines name the kernel: "single" is the old attention kernel, "PDL" the
#   launches behind DECODE_PDL); bench big --decode-only --profile --decode-variants (plain and
#   speculative on random weights: a pass's cost, the drafts are never right; the old attention
#   kernel and PDL launches for comparison; a step at position 17 and at 411..510, by kernel);
#   PyTorch's decoding, eager and compiled with CUDA graphs, in the same run; the GPU tests;
#   then, with time left, train big (600 steps) and bench on it (drafts that are right: the
#   speculative speed-up), and bench big again (the GPU's clocks after PyTorch).
# If check fails or a kernel faults, the bench runs again with the old attention kernel
# (DECODE_ATTENTION = "single"), so the rest of the changes still get their figures.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}
mkdir -p $O
t() { local s=$EPOCHREALTIME; "$@"; local rc=$?; echo "[timing] $* : $(awk "BEGIN{print $EPOCHREALTIME - $s}") s (rc $rc)"; return $rc; }
left() { [ $SECONDS -lt $1 ]; }            # still under $1 seconds since the start
banner() { echo; echo "=== $* (at ${SECONDS} s)"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/summary.log
git log --oneline -1 | tee -a $O/summary.log

banner check | tee -a $O/summary.log
t timeout 150 python nanoeuler_cuda.py check > $O/check.log 2>&1
check_rc=$?
grep -c " OK$" $O/check.log | sed 's/^/check OK lines: /' | tee -a $O/summary.log
grep -E "NOT OK|overall|Error|error|failed|\[timing\]" $O/check.log | tee -a $O/summary.log
grep -E "^decode bf16 (D=64 G=8 )?(step at 1[23]|3-row pass ==|PDL)" $O/check.log | tee -a $O/summary.log
[ $check_rc -ne 0 ] && tail -20 $O/check.log

banner "bench big --decode-only --profile --decode-variants" | tee -a $O/summary.log
t timeout 150 python nanoeuler_cuda.py bench big --decode-only --profile --decode-variants > $O/bench.log 2>&1
bench_rc=$?
cat $O/bench.log | tee -a $O/summary.log
if [ $check_rc -ne 0 ] || [ $bench_rc -ne 0 ]; then
  banner "bench with the old attention kernel (DECODE_ATTENTION = single)" | tee -a $O/summary.log
  t timeout 120 python -c "import nanoeuler_cuda as nc; nc.DECODE_ATTENTION = 'single'; nc.main(['bench', 'big', '--decode-only', '--profile'])" 2>&1 | tee $O/bench_single.log | tee -a $O/summary.log
fi

banner "PyTorch decoding, eager and compiled (reduce-overhead: CUDA graphs)" | tee -a $O/summary.log
left 470 && t timeout 60 python docs/pytorch_reference.py --decode 2>&1 | tail -3 | tee -a $O/summary.log
left 410 && t timeout 120 python docs/pytorch_reference.py --decode --compile 2>&1 | tail -3 | tee -a $O/summary.log

if left 330; then
  banner "GPU tests" | tee -a $O/summary.log
  t timeout 200 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py test_nanoeuler.py > $O/tests.log 2>&1
  tail -15 $O/tests.log | tee -a $O/summary.log
fi

if left 350; then
  banner "train big 600 steps, then decoding on it" | tee -a $O/summary.log
  t timeout 100 python nanoeuler_cuda.py train big --steps 600 --out out/big > $O/train.log 2>&1
  grep -E "^done|\[timing\]" $O/train.log | tail -2 | tee -a $O/summary.log
  [ -f out/big/best.safetensors ] && t timeout 80 python nanoeuler_cuda.py bench --decode-only --decode-variants --model out/big/best.safetensors 2>&1 | tee $O/bench_trained.log | tee -a $O/summary.log
fi

if left 470; then
  banner "bench big --decode-only again (after PyTorch)" | tee -a $O/summary.log
  t timeout 60 python nanoeuler_cuda.py bench big --decode-only 2>&1 | tee -a $O/summary.log
fi
banner "done" | tee -a $O/summary.log
