#!/bin/bash
# Issue 36: the TMA attention backward's dk/dv pass in the product (flash_attn.cu's
# attention_backward_dkv_tma_kernel_64, picked on sm_90 at D = 64 in bf16 beside the TMA forward; never run on a GPU
# before this) against other trees, on one H100 or H200 (bash dev/gpu/attn_bwd_ab.sh OUTDIR [TREE...], from the
# repository root; default ab_base; each tree made by hand: mkdir ab_base && git archive main | tar -x -C ab_base,
# or ../attn for the TMA forward alone): the GPU tests of test_cuda_pipeline.py; the big model's bf16 steps from its
# graph twice and kernel by kernel, the same bits (dev/gpu/step_bits.py); the variant's own GPU script (every
# version of dev/variants/attention_backward_tma.cu against float64, timed beside the product's passes); then
# dev/gpu/train_ab.sh into OUTDIR/ab: check (the TMA and mma.sync lines of the forward and backward), bench big at
# batch 64 and 16 in every tree twice, bench --profile at 64 in each (the attention kernels' ms a step and us a
# layer), PyTorch's best at 64 and 16 (PYTORCH=0: not); stops before the A/B if step_bits does not pass. About 9
# minutes with two trees.
source "$(dirname "$0")/common.sh"
t pytest_gpu.log timeout 120 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py -k "not emulator"
tail -1 "$R/pytest_gpu.log" | tee -a "$S"
t step_bits.log timeout 120 python dev/gpu/step_bits.py
cat "$R/step_bits.log" | tee -a "$S"
if ! grep -q "the same in all three" "$R/step_bits.log"; then   # (a hang or wrong bits: no check, bench waits on it)
  echo "step_bits did not pass: stopping before the A/B" | tee -a "$S"; exit 1
fi
t variant.log timeout 240 python dev/variants/attention_backward_tma.py
grep -E "OK$|x\)|all OK|NOT OK" "$R/variant.log" | tee -a "$S"
bash "$(dirname "$0")/train_ab.sh" "$R/ab" "${@:-ab_base}"
grep -E "^attention bf16 D=64 G=3 (forward|dq|dk|dv)" "$R/ab/check.log" | tee -a "$S"
cat "$R/ab/summary.log" >> "$S"
