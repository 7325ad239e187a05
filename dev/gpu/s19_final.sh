#!/bin/bash
# Session 19's landing run (bash dev/gpu/s19_final.sh OUTDIR), after switching on what s19.sh found to pay:
# dev/gpu/final.sh (check, bench beside PyTorch's best, the README flow, decoding beside PyTorch's), then
# train big at SPEC's mtp_weight (issue 36: its validation loss within 0.01 of 4.2631) into OUTDIR/train_big.log.
R=${1:?usage: bash $0 OUTDIR}
bash "$(dirname "$0")/final.sh" "$R"
python nanoeuler_cuda.py train big --out out/big_spec > "$R/train_big.log" 2>&1
grep -E "^done|rror" "$R/train_big.log" | tee -a "$R/summary.log"
