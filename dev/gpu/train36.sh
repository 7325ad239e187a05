#!/bin/bash
# Issue 36's A/B of 2026-12-05 (bash dev/gpu/train36.sh OUTDIR VARIANT_TREE): the variant's check;
# bench big at batch 64 and 16, main's tree (.) and the variant in turn, twice; bench --profile at
# 64 of each; the variant's train small twice (its checkpoints' bits compared) and train big (the
# README flow's validation loss, SPEC's mtp_weight); dev/variants/lt_forward_probe.py; PyTorch's best
# at 64 and 16 last. VARIANT_TREE: a copy of the tree with the variant applied, carried, e.g.
#   mkdir -p .carry/train36/tree && git archive HEAD | tar -x -C .carry/train36/tree &&
#   (cd .carry/train36/tree && patch -p1 < dev/variants/THE.diff)   # not git apply: inside the repository it applies nothing
# then run: bash .carry/train36/tree/dev/gpu/train36.sh $OUT .carry/train36/tree (about 5 minutes)
source "$(dirname "$0")/common.sh"
V=${1:?usage: bash $0 OUTDIR VARIANT_TREE}
DIGEST=$(cd "$(dirname "$0")" && pwd)/tensor_digest.py
(cd "$V" && t check.log python nanoeuler_cuda.py check)
echo "check (variant): $(grep -c ' OK$' "$R/check.log") OK, $(grep -c 'NOT OK' "$R/check.log") NOT OK" | tee -a "$S"
grep "NOT OK" "$R/check.log" | head | tee -a "$S"
for round in 1 2; do
  for b in 64 16; do
    for tree in . "$V"; do
      (cd "$tree" && python nanoeuler_cuda.py bench big --batch $b --no-decode) > "$R/b.log" 2>&1
      echo "round $round b$b $tree: $(grep -E 'ms/step|rror' "$R/b.log" | tail -1)" | tee -a "$S"
    done
  done
done
rm -f "$R/b.log"
for tree in . "$V"; do
  name=$([ "$tree" = . ] && echo main || echo variant)
  (cd "$tree" && python nanoeuler_cuda.py bench big --batch 64 --profile --no-decode) > "$R/profile_$name.log" 2>&1
  echo "profile $name: $(grep -E 'replayed|matmul|rmsnorm' "$R/profile_$name.log" | tr -s ' ' | tr '\n' ';')" | tee -a "$S"
done
for run in 1 2; do
  (cd "$V" && python nanoeuler_cuda.py train small --steps 30 --eval-every 1000 --save-every 1000 --out /tmp/small$run) \
    > "$R/small$run.log" 2>&1
  echo "train small $run: $(grep -E '^step' "$R/small$run.log" | tail -1)" | tee -a "$S"
  for f in /tmp/small$run/*.safetensors; do   # the digest of the tensors, past the header
    echo "  $(basename $f): $(python3 "$DIGEST" $f)" | tee -a "$S"
  done
done
cmp -s <(grep -oE 'loss [0-9.]+|norm +[0-9.]+' "$R/small1.log") <(grep -oE 'loss [0-9.]+|norm +[0-9.]+' "$R/small2.log") \
  && echo "train small: the same losses and norms every step" | tee -a "$S"
rm -f "$R/small1.log" "$R/small2.log"
(cd "$V" && t train_big.log python nanoeuler_cuda.py train big --out /tmp/big)
grep -vE "^step |^sample" "$R/train_big.log" | tail -3 | tee -a "$S"
(cd "$V" && t lt_probe.log timeout 120 python dev/variants/lt_forward_probe.py)
grep -E "B=|rror" "$R/lt_probe.log" | tee -a "$S"
for b in 64 16; do
  t torch_b$b.log timeout 150 python tools/pytorch_reference.py --compile reduce-overhead --batch $b
  grep -E "^PyTorch|Error" "$R/torch_b$b.log" | tail -2 | tee -a "$S"
done
