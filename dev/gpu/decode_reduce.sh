#!/bin/bash
# issue 35: decode_matvec's warp sums as one reduce-scatter (the tree in .carry/rs) and that plus the split
# attention's q read before this pass's keys (.carry/rsq: dev/variants/attention_decode_q_first.diff), against
# main, random weights of big, bf16: bench --decode-only in the three (round 1 by kernel); check in rsq; each
# stage's cost at 1, 2 and 4 rows in a graph (dev/variants/decode_stage_rows_probe.py) in main and rsq; the
# benches again; main's GPU tests. About 2 minutes on one H100 once the machine is up.
# bash dev/gpu/decode_reduce.sh OUTDIR (from main's root, .carry carried)
source dev/gpu/common.sh
decode_round 1 main rs rsq
(cd .carry/rsq && timeout 150 python nanoeuler_cuda.py check > "$R/check_rsq.log" 2>&1)
echo "check (rsq): rc $?, $(grep -c ' OK$' "$R/check_rsq.log") OK, $(grep -c 'NOT OK' "$R/check_rsq.log") NOT OK" | tee -a "$S"
grep "NOT OK" "$R/check_rsq.log" | head | tee -a "$S"
probe=$PWD/.carry/rs/dev/variants/decode_stage_rows_probe.py
for tree in main rsq; do
  [ "$tree" = main ] && dir=$PWD || dir=$PWD/.carry/$tree
  echo "== stages by rows, $tree" | tee -a "$S"
  (cd "$dir" && timeout 100 python "$probe" 2>&1 | tail -12) | tee -a "$S"
done
decode_round 2 rsq main
t pytest_gpu.log timeout 100 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py test_async_save.py -k "not emulator"
tail -3 "$R/pytest_gpu.log" | tee -a "$S"
