#!/bin/bash
# Session 19's one device call (bash dev/gpu/s19.sh OUTDIR), about 7 minutes on an H200: issue 35's A/B
# (dev/gpu/decode_layers_ab.sh into OUTDIR/dec), PyTorch's best batch-1 decoding beside it, then issue 36's
# (dev/gpu/train_ab.sh into OUTDIR/train, run in .carry/tmab: a copy of the working tree with
# PRODUCT_TMA_BACKWARD = True, made here, against the working tree). The logs go to OUTDIR/logs.tgz, the
# summaries stay.
# LIGHT=1 (about 5 minutes): the first decode_layers variant alone, one round of training benches, PyTorch at 64.
R=${1:?usage: bash $0 OUTDIR}; mkdir -p "$R"; R=$(cd "$R" && pwd); B=$PWD
export PYTHONUNBUFFERED=1
[ "$LIGHT" = 1 ] && export VARIANTS=pers2 ROUNDS=1 TORCH_BATCHES=64
timeout 280 bash dev/gpu/decode_layers_ab.sh "$R/dec"
timeout 100 python tools/pytorch_reference.py --decode --compile reduce-overhead 2>&1 | grep -E "tok/s|rror" |
  tail -3 | tee "$R/dec/torch_decode.log"
rm -rf .carry/tmab; mkdir -p .carry/tmab
tar -c --exclude=./.carry --exclude=./dev/logs --exclude=./out . | tar -x -C .carry/tmab
sed -i 's/^PRODUCT_TMA_BACKWARD = False/PRODUCT_TMA_BACKWARD = True/' .carry/tmab/nanoeuler_cuda.py
(cd .carry/tmab && timeout 270 bash dev/gpu/train_ab.sh "$R/train" "$B")
cp "$R/dec/summary.log" "$R/dec_summary.log"; cp "$R/train/summary.log" "$R/train_summary.log"
(cd "$R" && tar -czf logs.tgz dec train && rm -rf dec train)
