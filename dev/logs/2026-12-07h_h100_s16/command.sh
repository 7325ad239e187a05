#!/bin/bash
# s16 GPU call 1: check on main (TMA forward default), dk/dv TMA shapes (aligned-copy fix), check + step bits with the
# TMA backward on (bwd), bench b64/b16 main vs bwd, profile, PyTorch
export PYTHONUNBUFFERED=1
S0=$EPOCHREALTIME; el() { awk "BEGIN{print int($EPOCHREALTIME - $S0)}"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt; date -u | tee -a $OUT/gpu.txt
C=$PWD/.carry
cd $C/main
timeout 170 python nanoeuler_cuda.py check > $OUT/check_main.log 2>&1; echo "check main rc $? at $(el) s: $(grep -c ' OK$' $OUT/check_main.log) OK, $(grep -c 'NOT OK' $OUT/check_main.log) NOT OK"
grep -E "NOT OK|rror" $OUT/check_main.log | head -8
for s in "2 150 3 1" "2 152 3 1" "2 192 3 1" "4 320 12 4" "2 512 3 1" "1 77 6 2"; do
  timeout 40 python dev/gpu/dkv_tma_shapes.py $s > $OUT/shape.log 2>&1; echo "shape $s rc $?: $(grep -E 'TMA|mma|rror' $OUT/shape.log | tr '\n' ';' | cut -c1-300)"
done | tee $OUT/shapes.log
cd $C/bwd
timeout 170 python nanoeuler_cuda.py check > $OUT/check_bwd.log 2>&1; echo "check bwd rc $? at $(el) s: $(grep -c ' OK$' $OUT/check_bwd.log) OK, $(grep -c 'NOT OK' $OUT/check_bwd.log) NOT OK"
grep -E "NOT OK|rror" $OUT/check_bwd.log | head -8
timeout 60 python dev/gpu/step_bits.py > $OUT/step_bits.log 2>&1; echo "step_bits rc $? at $(el) s"; tail -2 $OUT/step_bits.log
for b in 64 16; do for tree in bwd main; do
  (cd $C/$tree && timeout 80 python nanoeuler_cuda.py bench big --batch $b --no-decode > $OUT/b.log 2>&1)
  echo "b$b $tree: $(grep -E 'ms/step|rror' $OUT/b.log | tail -1) [$(el) s]"
done; done
if [ $(el) -lt 420 ]; then (cd $C/.. && timeout 100 python tools/pytorch_reference.py --compile reduce-overhead --batch 64 > $OUT/torch_b64.log 2>&1); grep -E "^PyTorch|rror" $OUT/torch_b64.log | tail -2; echo "at $(el) s"; fi
if [ $(el) -lt 470 ]; then (cd $C/bwd && timeout 50 python nanoeuler_cuda.py bench big --batch 64 --profile --no-decode > $OUT/profile_bwd.log 2>&1); grep -E "replayed|attention" $OUT/profile_bwd.log | head -8; fi
if [ $(el) -lt 520 ]; then for tree in bwd main; do
  (cd $C/$tree && timeout 40 python nanoeuler_cuda.py bench big --batch 64 --no-decode > $OUT/b.log 2>&1)
  echo "round 2 b64 $tree: $(grep -E 'ms/step|rror' $OUT/b.log | tail -1) [$(el) s]"; done; fi
echo "done at $(el) s"
