#!/bin/bash
# s17 GPU call 1: PRODUCT_TMA A/B (gemm = main + PRODUCT_TMA True; rope = gemm + rope backward in every pass), NN/TN probe, train big val loss
export PYTHONUNBUFFERED=1
S0=$EPOCHREALTIME; el() { awk "BEGIN{print int($EPOCHREALTIME - $S0)}"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt; date -u | tee -a $OUT/gpu.txt
C=$PWD/.carry
for tree in gemm rope; do
(cd $C/$tree && timeout 90 python nanoeuler_cuda.py check > $OUT/check_$tree.log 2>&1); echo "check $tree rc $? at $(el) s: $(grep -c ' OK$' $OUT/check_$tree.log) OK, $(grep -c 'NOT OK' $OUT/check_$tree.log) NOT OK"
grep -E "NOT OK|rror" $OUT/check_$tree.log | head -5; grep -iE "^ *product" $OUT/check_$tree.log | head -8
(cd $C/$tree && timeout 60 python dev/gpu/step_bits.py > $OUT/step_bits_$tree.log 2>&1); echo "step_bits $tree rc $? at $(el) s"; tail -2 $OUT/step_bits_$tree.log
done
for b in 64 16; do for tree in gemm rope main; do
  (cd $C/$tree && timeout 40 python nanoeuler_cuda.py bench big --batch $b --no-decode > $OUT/b.log 2>&1)
  echo "b$b $tree: $(grep -E 'ms/step|rror' $OUT/b.log | tail -1) [$(el) s]"
done; done
(cd $C/main && timeout 80 python dev/variants/wgmma_probe.py > $OUT/wgmma_probe.log 2>&1); echo "wgmma_probe rc $? at $(el) s"; sed -n '/us a call/,$p' $OUT/wgmma_probe.log | tail -30; grep "NOT OK" $OUT/wgmma_probe.log | head -5
(cd $C/gemm && timeout 40 python nanoeuler_cuda.py bench big --batch 64 --profile --no-decode > $OUT/profile_gemm.log 2>&1); grep -E "replayed|matmul|swiglu|rope|attention_" $OUT/profile_gemm.log | head -14
for tree in gemm rope main; do
  (cd $C/$tree && timeout 40 python nanoeuler_cuda.py bench big --batch 64 --no-decode > $OUT/b.log 2>&1)
  echo "round 2 b64 $tree: $(grep -E 'ms/step|rror' $OUT/b.log | tail -1) [$(el) s]"; done
(cd $C/main && timeout 100 python tools/pytorch_reference.py --compile reduce-overhead --batch 64 > $OUT/torch_b64.log 2>&1); grep -E "^PyTorch|rror" $OUT/torch_b64.log | tail -1; echo "at $(el) s"
if [ $(el) -lt 420 ]; then ln -s $PWD/data $C/gemm/data; (cd $C/gemm && timeout 120 python nanoeuler_cuda.py train big --out /tmp/big > $OUT/train_big_gemm.log 2>&1); echo "train big gemm rc $? at $(el) s"; grep -vE "^step |^sample" $OUT/train_big_gemm.log | tail -4; fi
if [ $(el) -lt 480 ]; then (cd $C/main && timeout 60 python tools/pytorch_reference.py --compile reduce-overhead --batch 16 > $OUT/torch_b16.log 2>&1); grep -E "^PyTorch|rror" $OUT/torch_b16.log | tail -1; fi
rm -f $OUT/b.log; echo "done at $(el) s"
