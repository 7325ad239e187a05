#!/bin/bash
# issue 35: the wo product's combine with its index math and the residual's load before decode_wait /
# the combine (the tree in .carry/comb) against main, random weights of big, bf16: bench --decode-only
# in both, three rounds in turn (round 1 by kernel); check in comb; each stage's cost at 1, 2 and 4 rows
# in a graph in both ("wo (combine, +=)" against "wo (plain, +=)"); comb's GPU tests. About 2 minutes
# on one H100 once the machine is up. bash dev/gpu/decode_combine.sh OUTDIR
# (.carry/comb: a copy of main with dev/variants/decode_combine_cheaper.diff applied by patch -p1:
#  mkdir -p .carry/comb && git archive HEAD | tar -x -C .carry/comb &&
#  (cd .carry/comb && patch -p1 < dev/variants/decode_combine_cheaper.diff))
source dev/gpu/common.sh
decode_round 1 main comb
(cd .carry/comb && timeout 150 python nanoeuler_cuda.py check > "$R/check_comb.log" 2>&1)
echo "check (comb): rc $?, $(grep -c ' OK$' "$R/check_comb.log") OK, $(grep -c 'NOT OK' "$R/check_comb.log") NOT OK" | tee -a "$S"
grep "NOT OK" "$R/check_comb.log" | head | tee -a "$S"
for tree in main comb; do
  [ "$tree" = main ] && dir=$PWD || dir=$PWD/.carry/$tree
  echo "== stages by rows, $tree" | tee -a "$S"
  (cd "$dir" && timeout 100 python dev/variants/decode_stage_rows_probe.py 2>&1 | tail -12) | tee -a "$S"
done
decode_round 2 comb main
decode_round 3 main comb
(cd .carry/comb && timeout 100 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py -k "not emulator" > "$R/pytest_comb.log" 2>&1)
tail -1 "$R/pytest_comb.log" | tee -a "$S"
