#!/bin/bash
# issue 35: a decoding variant (the tree in .carry/TREE, e.g. main with a dev/variants diff applied) against
# main, random weights of big, bf16: bench --decode-only in both, three rounds in turn (round 1 by kernel);
# check in TREE; each stage's cost at 1, 2 and 4 rows in a graph (dev/variants/decode_stage_rows_probe.py) in
# both; TREE's GPU tests. About 2 minutes on one H100 once the machine is up.
# bash dev/gpu/decode_variant.sh OUTDIR TREE, e.g. for a diff in dev/variants:
#   mkdir -p .carry/v && git archive HEAD | tar -x -C .carry/v && (cd .carry/v && patch -p1 < ../../dev/variants/X.diff)
#   bash dev/gpu/decode_variant.sh OUTDIR v
source dev/gpu/common.sh
V=${1:?usage: bash $0 OUTDIR TREE (TREE: the variant, in .carry/TREE)}
decode_round 1 main "$V"
(cd ".carry/$V" && timeout 150 python nanoeuler_cuda.py check > "$R/check_$V.log" 2>&1)
echo "check ($V): rc $?, $(grep -c ' OK$' "$R/check_$V.log") OK, $(grep -c 'NOT OK' "$R/check_$V.log") NOT OK" | tee -a "$S"
grep "NOT OK" "$R/check_$V.log" | head | tee -a "$S"
for tree in main "$V"; do
  [ "$tree" = main ] && dir=$PWD || dir=$PWD/.carry/$tree
  echo "== stages by rows, $tree" | tee -a "$S"
  (cd "$dir" && timeout 100 python dev/variants/decode_stage_rows_probe.py 2>&1 | tail -12) | tee -a "$S"
done
decode_round 2 "$V" main
decode_round 3 main "$V"
(cd ".carry/$V" && timeout 100 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py -k "not emulator" > "$R/pytest_$V.log" 2>&1)
tail -1 "$R/pytest_$V.log" | tee -a "$S"
