#!/bin/bash
# The README's one-GPU flow (train big --mtp-weight 1.5, sft, chat greedy and --speculative,
# bench --decode-only on that SFT model), logs into OUTDIR/flow (bash dev/gpu/flow_mtp.sh OUTDIR)
source "$(dirname "$0")/common.sh"
L=$R/flow; mkdir -p "$L"
readme_flow
cp "$R"/chat_*.log "$L/"
