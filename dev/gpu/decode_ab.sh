#!/bin/bash
# Decoding variants against main (issue 35), in one call from main's root with each variant's tree in
# .carry/NAME (bash dev/gpu/decode_ab.sh OUTDIR NAME...), about 90 s a tree: check in each variant; bench
# --decode-only on random weights of big in main and each variant, two rounds (the first with --profile:
# the passes over 1-4 rows); dev/variants/decode_stage_probe.py (each stage's launch cost) in each.
source "$(dirname "$0")/common.sh"
here=$PWD; trees=("$here"); for n in "$@"; do trees+=("$here/.carry/$n"); done
name() { [ "$1" = "$here" ] && echo main || basename "$1"; }
keep="tok/s|a pass over [1-4] rows? and 1 head|one step at position 17|prefill|rror"
for tree in "${trees[@]:1}"; do
  (cd "$tree" && timeout 150 python nanoeuler_cuda.py check > "$R/check_$(name "$tree").log" 2>&1)
  echo "check ($(name "$tree")): rc $?, $(grep -c ' OK$' "$R/check_$(name "$tree").log") OK," \
       "$(grep -c 'NOT OK' "$R/check_$(name "$tree").log") NOT OK" | tee -a "$S"
  grep "NOT OK" "$R/check_$(name "$tree").log" | head | tee -a "$S"
done
for round in 1 2; do for tree in "${trees[@]}"; do
  opts=$([ $round = 1 ] && echo --profile); log=$R/bench_${round}_$(name "$tree").log
  echo "== random weights, round $round, $(name "$tree") $opts" | tee -a "$S"
  (cd "$tree" && timeout 120 python nanoeuler_cuda.py bench --decode-only $opts > "$log" 2>&1)
  grep -E "$keep" "$log" | grep -v "^    [a-z_]" | tee -a "$S"
done; done
for tree in "${trees[@]}"; do
  echo "== stage probe, $(name "$tree")" | tee -a "$S"
  (cd "$tree" && timeout 120 python dev/variants/decode_stage_probe.py 2>&1) | tee -a "$S"
done
