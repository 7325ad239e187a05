#!/bin/bash
# issue 35: the split attention's scores reduce-scattered over a key's lanes, one exp a (sweep, head) pair (the
# tree in .carry/att) against main, random weights of big, bf16: bench --decode-only in both, three rounds in
# turn (round 1 by kernel); check in att; each stage's cost at 1, 2 and 4 rows in a graph in both; att's GPU
# tests. About 2 minutes on one H100 once the machine is up. bash dev/gpu/decode_attention_rs.sh OUTDIR
# (.carry/att: a copy of main with dev/variants/attention_decode_scores_reduce_scatter.diff applied by patch -p1)
source dev/gpu/common.sh
decode_round 1 main att
(cd .carry/att && timeout 150 python nanoeuler_cuda.py check > "$R/check_att.log" 2>&1)
echo "check (att): rc $?, $(grep -c ' OK$' "$R/check_att.log") OK, $(grep -c 'NOT OK' "$R/check_att.log") NOT OK" | tee -a "$S"
grep "NOT OK" "$R/check_att.log" | head | tee -a "$S"
for tree in main att; do
  [ "$tree" = main ] && dir=$PWD || dir=$PWD/.carry/$tree
  echo "== stages by rows, $tree" | tee -a "$S"
  (cd "$dir" && timeout 100 python dev/variants/decode_stage_rows_probe.py 2>&1 | tail -12) | tee -a "$S"
done
decode_round 2 att main
decode_round 3 main att
(cd .carry/att && timeout 100 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py -k "not emulator" > "$R/pytest_att.log" 2>&1)
tail -1 "$R/pytest_att.log" | tee -a "$S"
