#!/bin/bash
# Did reverting the epilogue add (482a292) bring the README flow's SFT model back? (bash dev/gpu/sft_ab.sh OUTDIR BASE)
# BASE: a tree of f7ae078 (git archive f7ae078 | tar -x -C BASE). On main: check, bench big 64/16, PyTorch's best at
# 64, the README flow (train big --mtp-weight 1.5, sft, chat, decoding on the SFT model); then with BASE's code:
# sft from main's pre-trained model, and the whole flow of its own, each with decoding on its SFT model; last,
# decoding on random weights and the GPU tests. About 6 minutes on one H100 or H200.
source "$(dirname "$0")/common.sh"
B=$(realpath "${1:?usage: bash $0 OUTDIR BASE}")
L=$R/logs; mkdir -p "$L"
run_check && mv "$R/check.log" "$L/"
for b in 64 16; do
  python nanoeuler_cuda.py bench big --batch $b --no-decode > "$L/bench_b$b.log" 2>&1
  echo "bench b$b: $(grep -E 'ms/step|rror' "$L/bench_b$b.log" | tail -1)" | tee -a "$S"
done
t torch_b64.log timeout 100 python tools/pytorch_reference.py --compile reduce-overhead --batch 64
grep -E "^PyTorch|Error" "$R/torch_b64.log" | tail -1 | tee -a "$S"; mv "$R/torch_b64.log" "$L/"
echo "== main: the README flow" | tee -a "$S"
readme_flow
main=$PWD; mkdir -p "$L/main"; mv "$L"/*.log "$R"/chat_*.log "$L/main/"
echo "== f7ae078: sft from main's pre-trained model" | tee -a "$S"
cd "$B"
t sft_base_from_main.log python nanoeuler_cuda.py sft --model "$main/out/big/best.safetensors" --out out/sft_main
grep -vE "^step |^sample" "$R/sft_base_from_main.log" | tail -3 | tee -a "$S"; mv "$R/sft_base_from_main.log" "$L/"
python nanoeuler_cuda.py bench --decode-only --model out/sft_main/best.safetensors 2>&1 | grep -E "tok/s|prefill" | tee -a "$S"
echo "== f7ae078: the README flow of its own" | tee -a "$S"
readme_flow
cd "$main"
t decode_random.log timeout 60 python nanoeuler_cuda.py bench --decode-only
grep -hE "tok/s|prefill" "$R/decode_random.log" | tee -a "$S"; mv "$R/decode_random.log" "$L/"
t pytest_gpu.log timeout 100 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py test_async_save.py -k "not emulator"
tail -3 "$R/pytest_gpu.log" | tee -a "$S"; mv "$R/pytest_gpu.log" "$L/"
mv "$R"/chat_*.log "$L/"
(cd "$R" && tar -czf logs.tgz logs && rm -rf logs)
