#!/bin/bash
# decode_layers (issue 35: a pass's layers as one kernel) against the layers' kernels one by one, on one GPU, from
# the repository root (bash dev/gpu/decode_layers_ab.sh OUTDIR): copies of the working tree in .carry/pers2
# (DECODE_PERSISTENT = True) and .carry/pers1 (the same with launch bounds (256, 1): no spills, one block an SM);
# check_decoding in each (dev/gpu/check_decoding.py: "kernels one by one == default (bits)"; stops before the
# timings if pers2's fails); bench --decode-only in main, pers2 and pers1, two rounds (the first with --profile).
source "$(dirname "$0")/common.sh"
R=$(cd "$R" && pwd); S=$R/summary.log                   # (the trees below run from their own folders)
VARIANTS=${VARIANTS:-pers2 pers1}                       # VARIANTS=pers2: the first alone
for n in $VARIANTS; do
  rm -rf ".carry/$n"; mkdir -p ".carry/$n"
  tar -c --exclude=./.carry --exclude=./data --exclude=./dev/logs --exclude=./out . | tar -x -C ".carry/$n"
  sed -i 's/^DECODE_PERSISTENT = False/DECODE_PERSISTENT = True/' ".carry/$n/nanoeuler_cuda.py"
done
[ -d .carry/pers1 ] &&
  sed -i 's/__launch_bounds__(256, 2) decode_layers_/__launch_bounds__(256, 1) decode_layers_/' .carry/pers1/kernels.cu
for n in $VARIANTS; do
  (cd ".carry/$n" && t "check_decoding_$n.log" timeout 150 python dev/gpu/check_decoding.py)
  grep -E "NOT OK|one by one|overall" "$R/check_decoding_$n.log" | tee -a "$S"
done
if ! grep -q "overall okay: 1" "$R/check_decoding_pers2.log"; then
  echo "check_decoding failed in pers2: stopping before the timings" | tee -a "$S"; exit 1
fi
decode_round 1 main $VARIANTS
decode_round 2 main $VARIANTS
