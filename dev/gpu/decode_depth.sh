#!/bin/bash
# issue 35: DraftPolicy choosing how many drafts to feed (main) against the policy before it (.carry/old), which
# feeds --drafts always while drafting pays. Models: the README flow's SFT model (train big --mtp-weight 1.5, sft),
# a model pre-trained at SPEC's weight 0.5 (train big), random weights; bench --decode-only in both trees,
# the flow's model in two rounds in turn; main's GPU tests. About 6 minutes
# on one H100 or H200. bash dev/gpu/decode_depth.sh OUTDIR
# (.carry/old: git archive 7fab4e3 | tar -x -C .carry/old, the last commit before the policy)
source dev/gpu/common.sh
t train15.log python nanoeuler_cuda.py train big --mtp-weight 1.5 --out out/big15
grep -vE "^step |^sample" "$R/train15.log" | tail -2 | tee -a "$S"
t sft15.log python nanoeuler_cuda.py sft --model out/big15/best.safetensors --out out/sft15
grep -vE "^step |^sample" "$R/sft15.log" | tail -2 | tee -a "$S"
t train05.log python nanoeuler_cuda.py train big --out out/big05
grep -vE "^step |^sample" "$R/train05.log" | tail -2 | tee -a "$S"
bench_model() {   # bench_model LABEL TREE [--model FILE]: bench --decode-only in TREE (main: here, else .carry/TREE)
  local label=$1 tree=$2 dir; shift 2
  [ "$tree" = main ] && dir=$PWD || dir=$PWD/.carry/$tree
  echo "== $label, $tree" | tee -a "$S"
  (cd "$dir" && timeout 150 python nanoeuler_cuda.py bench --decode-only "$@" > "$R/bench_${label}_$tree.log" 2>&1)
  grep -E "tok/s|prefill|rror" "$R/bench_${label}_$tree.log" | tee -a "$S"
}
bench_model flow1 old --model "$PWD/out/sft15/best.safetensors"
bench_model flow1 main --model "$PWD/out/sft15/best.safetensors"
bench_model flow2 main --model "$PWD/out/sft15/best.safetensors"
bench_model flow2 old --model "$PWD/out/sft15/best.safetensors"
bench_model spec05 old --model "$PWD/out/big05/best.safetensors"
bench_model spec05 main --model "$PWD/out/big05/best.safetensors"
bench_model random main
bench_model random old
(timeout 120 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py -k "not emulator" > "$R/pytest_main.log" 2>&1)
tail -1 "$R/pytest_main.log" | tee -a "$S"
