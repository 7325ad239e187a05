#!/bin/bash
# A/B of issue 35's decode_qkv_attention and issue 36's residual add in the epilogue, each against f7ae078 (base),
# with the diffs applied by patch -p1 (the 08:35 runs applied nothing: git apply inside the repo skipped them).
# Made, then carried as .carry (about 4 minutes on an H100; dev/logs/2026-12-05_h100/2_ab/):
#   for d in base decode35/tree train36/tree; do mkdir -p .carry/$d; git archive f7ae078 | tar -x -C .carry/$d; done
#   (cd .carry/decode35/tree && patch -p1 < dev/variants/decode_qkv_attention.diff)
#   (cd .carry/train36/tree && patch -p1 < dev/variants/residual_add_in_product_epilogue.diff)  # f78e686's
#   bash .carry/ab.sh OUTDIR     # this file, copied to .carry/ab.sh
export PYTHONUNBUFFERED=1
R=$1; mkdir -p $R; S=$R/summary.log
B=$PWD/.carry/base; D=$PWD/.carry/decode35/tree; T=$PWD/.carry/train36/tree
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee -a $S
for tree in $D $T; do (cd $tree && timeout 90 python nanoeuler_cuda.py check > $R/check_$(basename $(dirname $tree)).log 2>&1); echo "check $tree: rc $? $(grep -c ' OK$' $R/check_$(basename $(dirname $tree)).log) OK, $(grep -c 'NOT OK' $R/check_$(basename $(dirname $tree)).log) NOT OK" | tee -a $S; done
grep -h "NOT OK\|two kernels" $R/check_*.log | head | tee -a $S
keep="tok/s|a pass over|one step|prefill|same tokens|decoding on|rror"
for round in 1 2; do for tree in $B $D; do
  opts=$([ $tree = $D ] && echo --decode-variants)$([ $round = 1 ] && echo " --profile")
  echo "== decode random $round $tree $opts" | tee -a $S
  (cd $tree && timeout 100 python nanoeuler_cuda.py bench --decode-only $opts > $R/dec.log 2>&1); echo "rc $?" | tee -a $S
  grep -E "$keep" $R/dec.log | grep -v "^    [a-z_]" | tee -a $S; [ $round = 1 ] && cp $R/dec.log $R/dec_$(basename $(dirname $tree))_profile.log
done; done
for round in 1 2; do for b in 64 16; do for tree in $B $T; do
  (cd $tree && timeout 60 python nanoeuler_cuda.py bench big --batch $b --no-decode) > $R/b.log 2>&1
  echo "train round $round b$b $tree: $(grep -E 'ms/step|rror' $R/b.log | tail -1)" | tee -a $S
done; done; done
(cd $T && timeout 60 python nanoeuler_cuda.py bench big --batch 64 --profile --no-decode) > $R/profile_variant.log 2>&1
echo "profile variant: $(grep -E 'replayed|matmul' $R/profile_variant.log | tr -s ' ' | tr '\n' ';')" | tee -a $S
for run in 1 2; do
  (cd $T && timeout 60 python nanoeuler_cuda.py train small --steps 30 --eval-every 1000 --save-every 1000 --out /tmp/small$run) > $R/small$run.log 2>&1
  echo "variant train small $run: $(grep -E '^step' $R/small$run.log | tail -1 | cut -c1-60) $(python3 $T/dev/gpu/tensor_digest.py /tmp/small$run/model_000030.safetensors)" | tee -a $S
done
(cd $T && timeout 90 python nanoeuler_cuda.py train big --out /tmp/big) > $R/train_big_variant.log 2>&1
grep -vE "^step |^sample" $R/train_big_variant.log | tail -3 | head -1 | tee -a $S
rm -f $R/b.log $R/dec.log $R/small*.log
