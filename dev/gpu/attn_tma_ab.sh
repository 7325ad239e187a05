#!/bin/bash
# Issue 36: the TMA attention forward in the product (flash_attn.cu's attention_forward_tma_kernel_64, picked on
# sm_90 at D = 64 in bf16) against a copy of main, on one H100 or H200 (bash dev/gpu/attn_tma_ab.sh OUTDIR, from
# the repository root, with ab_base made by hand: mkdir ab_base && git archive main | tar -x -C ab_base): the GPU
# tests of test_cuda_pipeline.py; the big model's bf16 steps from its graph twice and kernel by kernel, the same
# bits (dev/gpu/step_bits.py); then dev/gpu/train_ab.sh into OUTDIR/ab: check (the TMA forward's line, and the
# mma.sync one's beside it), bench big at batch 64 and 16 in both trees twice, bench --profile at 64 in each (the
# attention forward's us a layer), PyTorch's best at 64 and 16 (PYTORCH=0: not). About 7 minutes.
source "$(dirname "$0")/common.sh"
t pytest_gpu.log timeout 120 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py -k "not emulator"
tail -1 "$R/pytest_gpu.log" | tee -a "$S"
t step_bits.log timeout 120 python dev/gpu/step_bits.py
cat "$R/step_bits.log" | tee -a "$S"
bash "$(dirname "$0")/train_ab.sh" "$R/ab" "${@:-ab_base}"
grep -E "^attention bf16 D=64 G=3 forward" "$R/ab/check.log" | tee -a "$S"
cat "$R/ab/summary.log" >> "$S"
