#!/bin/bash
# s15 GPU call: attnbwd (TMA forward + TMA dk/dv) and attn (TMA forward) against main (ab_base):
# check in attnbwd (both forwards and both backwards against numpy), step bits, one bench round each, profile, PyTorch
export PYTHONUNBUFFERED=1
S0=$EPOCHREALTIME; el() { awk "BEGIN{print int($EPOCHREALTIME - $S0)}"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt; date -u | tee -a $OUT/gpu.txt
cd .carry/bwd
timeout 150 python nanoeuler_cuda.py check > $OUT/check.log 2>&1; echo "check rc $? at $(el) s: $(grep -c ' OK$' $OUT/check.log) OK, $(grep -c 'NOT OK' $OUT/check.log) NOT OK"
grep -E "NOT OK|rror|D=64 G=3" $OUT/check.log | head -12
timeout 60 python dev/gpu/step_bits.py > $OUT/step_bits.log 2>&1; echo "step_bits rc $? at $(el) s"; tail -2 $OUT/step_bits.log
for b in 64 16; do for tree in . ../attn ../ab_base; do
  (cd $tree && timeout 80 python nanoeuler_cuda.py bench big --batch $b --no-decode > $OUT/b.log 2>&1)
  echo "b$b $tree: $(grep -E 'ms/step|rror' $OUT/b.log | tail -1) [$(el) s]"
done; done
timeout 50 python nanoeuler_cuda.py bench big --batch 64 --profile --no-decode > $OUT/profile.log 2>&1
grep -E "replayed|attention" $OUT/profile.log | head -8
timeout 100 python tools/pytorch_reference.py --compile reduce-overhead --batch 64 > $OUT/torch_b64.log 2>&1; grep -E "^PyTorch|rror" $OUT/torch_b64.log | tail -2; echo "at $(el) s"
if [ $(el) -lt 380 ]; then timeout 90 python tools/pytorch_reference.py --compile reduce-overhead --batch 16 > $OUT/torch_b16.log 2>&1; grep -E "^PyTorch|rror" $OUT/torch_b16.log | tail -2; fi
if [ $(el) -lt 400 ]; then for b in 64; do for tree in . ../attn ../ab_base; do
  (cd $tree && timeout 40 python nanoeuler_cuda.py bench big --batch $b --no-decode > $OUT/b.log 2>&1)
  echo "round 2 b$b $tree: $(grep -E 'ms/step|rror' $OUT/b.log | tail -1) [$(el) s]"; done; done; fi
