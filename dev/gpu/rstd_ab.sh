#!/bin/bash
# decode_matvec's 1/rms summed after its products (from L1) against main (issue 35), in one call from main's
# root with the variant's tree in .carry/rstd (bash dev/gpu/rstd_ab.sh OUTDIR), about 3 minutes: check in the
# variant; bench --decode-only on random weights of big in both trees, two rounds (the first with --profile);
# dev/variants/decode_stage_probe.py (each stage's launch cost in a graph of 83 copies) in both; the
# launch-boundary floor (dev/variants/pdl_floor_probe.py).
source "$(dirname "$0")/common.sh"
V=$PWD/.carry/rstd; here=$PWD
keep="tok/s|a pass over 1 row and 1 head|a pass over 2 rows and 1 head|a pass over 4 rows and 1 head|one step at position 17|prefill|rror"
(cd $V && timeout 120 python nanoeuler_cuda.py check > "$R/check_variant.log" 2>&1)
echo "check (variant): rc $?, $(grep -c ' OK$' "$R/check_variant.log") OK, $(grep -c 'NOT OK' "$R/check_variant.log") NOT OK" | tee -a "$S"
grep "NOT OK" "$R/check_variant.log" | head | tee -a "$S"
for round in 1 2; do for tree in $here $V; do
  name=$([ $tree = $here ] && echo main || echo variant); opts=$([ $round = 1 ] && echo --profile)
  echo "== random weights, round $round, $name $opts" | tee -a "$S"
  (cd $tree && timeout 120 python nanoeuler_cuda.py bench --decode-only $opts > "$R/bench_${round}_$name.log" 2>&1)
  grep -E "$keep" "$R/bench_${round}_$name.log" | grep -v "^    [a-z_]" | tee -a "$S"
done; done
for tree in $here $V; do
  name=$([ $tree = $here ] && echo main || echo variant)
  echo "== stage probe, $name" | tee -a "$S"
  (cd $tree && timeout 120 python dev/variants/decode_stage_probe.py 2>&1) | tee -a "$S"
done
echo "== launch-boundary floor" | tee -a "$S"
timeout 120 python dev/variants/pdl_floor_probe.py 2>&1 | tee -a "$S"
