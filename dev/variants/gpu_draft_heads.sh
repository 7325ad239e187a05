#!/bin/bash
# Would longer pre-training, or a larger weight on the extra heads, make head 1 a better
# drafter? (bash dev/variants/gpu_draft_heads.sh OUTDIR, one GPU, ~5 min.) Each: train big, sft on
# the embedded instructions, then dev/variants/draft_ranks.py on that SFT model.
#   long: train big --steps 1200 (twice the README flow's 600), SPEC's mtp_weight 0.5
#   mtp:  train big --steps 600 with mtp_weight 1.5 (head 1's share of the loss 0.5, not 0.167)
source "$(dirname "$0")/../gpu/common.sh"
t train_long.log python nanoeuler_cuda.py train big --steps 1200 --out out/long
t sft_long.log python nanoeuler_cuda.py sft --model out/long/best.safetensors --out out/sft_long
t train_mtp.log python -c "import dataclasses, nanoeuler as ne, nanoeuler_cuda as nc
ne.PRESETS['big'] = dataclasses.replace(ne.PRESETS['big'], mtp_weight=1.5)
nc.main(['train', 'big', '--out', 'out/mtp'])"
t sft_mtp.log python nanoeuler_cuda.py sft --model out/mtp/best.safetensors --out out/sft_mtp
for run in long mtp; do
  for log in train sft; do grep -vE "^step |^sample" "$R/${log}_$run.log" | tail -2 | sed "s/^/$run $log: /" | tee -a "$S"; done
  python dev/variants/draft_ranks.py out/sft_$run/best.safetensors "$R/ranks_$run.npz" 2>&1 | grep -vE "^pass over" |
    sed "s/^/$run: /" | tee -a "$S"
done
