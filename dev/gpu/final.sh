#!/bin/bash
# The closing device run of a change (bash dev/gpu/final.sh OUTDIR; OUTDIR: summary.log, the chat
# transcripts and logs.tgz), about 7 minutes on an H200: check; bench big at batch 64 and 16;
# PyTorch (torch.compile with CUDA graphs) at 64 and 16; bench at 64 and 16 again; then the
# README's flow: train big, sft, chat greedy and --speculative, decoding speed on that SFT model;
# then decoding on random weights beside PyTorch's best (496 new tokens each). (On 2026-12-02 the
# last two ran as a command of their own after the rest: dev/logs/h200_final/decode_vs_pytorch_summary.log.)
source "$(dirname "$0")/common.sh"
L=$R/logs; mkdir -p "$L"
run_check && mv "$R/check.log" "$L/"
bench() { t bench_b$1_$2.log python nanoeuler_cuda.py bench big --batch $1 --no-decode; grep -E "ms/step|rror" "$R/bench_b$1_$2.log" | tee -a "$S"; mv "$R/bench_b$1_$2.log" "$L/"; }
bench 64 1; bench 16 1
for b in 64 16; do
  t torch_b$b.log python tools/pytorch_reference.py --compile reduce-overhead --batch $b
  grep -E "^PyTorch|Error" "$R/torch_b$b.log" | tail -2 | tee -a "$S"; mv "$R/torch_b$b.log" "$L/"
done
bench 64 2; bench 16 2
readme_flow
t decode_random.log python nanoeuler_cuda.py bench --decode-only --max-new-tokens 496
grep -hE "tok/s|prefill" "$R/decode_random.log" | tee -a "$S"; mv "$R/decode_random.log" "$L/"
t torch_decode.log timeout 150 python tools/pytorch_reference.py --decode --compile reduce-overhead
grep -E "tok/s|rror" "$R/torch_decode.log" | tail -3 | tee -a "$S"; mv "$R/torch_decode.log" "$L/"
(cd "$R" && tar -czf logs.tgz logs && rm -rf logs)
