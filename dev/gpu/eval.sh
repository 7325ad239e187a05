# tools/eval.py on the GPU (bash dev/gpu/eval.sh OUTDIR; about 2 minutes on an H200, no network).
# Needs, carried to the device: data/eval (python tools/eval.py --fetch; 13 MB) and the small model
# out/small/best.safetensors (python nanoeuler.py train --out out/small; 4 MB). Uses out/big and
# out/sft's best.safetensors where a run before it in the same call left them (dev/gpu/common.sh's
# readme_flow); without out/big it times a random big model (chance scores, real speed).
#  1. CPU against GPU on the first 1,000 HellaSwag items with the small model: the same choices in
#     fp32 (all), and in bf16 (at least 99%)
#  2. the small model, every base task, whole, on the GPU (bf16); where the whole out/small was
#     carried (29 MB), each of its checkpoints too (--run: eval.csv)
#  3. the big model, every base task, whole (HellaSwag's 10,042 items: the seconds in the summary)
#  4. the SFT model, --chat: ARC whole, GSM8K's first 64 items
# OUTDIR: summary.log (the tables, the timings), *.json (every result), *.log (each command's output).
source "$(dirname "$0")/common.sh"
EV=${EVAL_CMD:-python tools/eval.py --quiet}     # EVAL_CMD: another command line (a dry run on the CPU)
SMALL=${EVAL_SMALL:-out/small/best.safetensors}
BIG=${EVAL_BIG:-out/big/best.safetensors}
SFT=${EVAL_SFT:-out/sft/best.safetensors}
[ -f data/eval/SHA256SUMS ] || { echo "data/eval is missing: carry it (python tools/eval.py --fetch makes it)" | tee -a "$S"; exit 2; }
table() { grep -vE "^results:|^mmlu:" "$R/$1" | tee -a "$S"; }
seconds() { python -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1] + f\": setup {r['setup_seconds']} s, \" + ', '.join(f\"{t['task']} {t['seconds']} s\" for t in r['tasks']))" "$1" | tee -a "$S"; }

if [ -f "$SMALL" ]; then
  echo "== 1. CPU and GPU, small model, HellaSwag's first 1,000 items" | tee -a "$S"
  t cpu_1000.log $EV --model "$SMALL" --tasks hellaswag --limit 1000 --json "$R/cpu_1000.json"
  t gpu_1000_fp32.log $EV --model "$SMALL" --tasks hellaswag --limit 1000 --gpu --precision fp32 --json "$R/gpu_1000_fp32.json"
  t gpu_1000_bf16.log $EV --model "$SMALL" --tasks hellaswag --limit 1000 --gpu --precision bf16 --json "$R/gpu_1000_bf16.json"
  python - "$R" <<'EOF' | tee -a "$S"
import json, sys
preds = lambda name: json.load(open(f"{sys.argv[1]}/{name}.json"))["tasks"][0]["preds"]
cpu = preds("cpu_1000")
for p in ("fp32", "bf16"):
    gpu = preds(f"gpu_1000_{p}")
    both = [(a, b) for a, b in zip(cpu, gpu) if a is not None]
    for k, what in ((0, "acc (sum)"), (1, "acc_norm (mean)")):
        same = sum(a[k] == b[k] for a, b in both)
        print(f"{p}: {what} choices the same as the CPU's on {same:,} of {len(both):,} items ({same / len(both):.2%})")
EOF
  table cpu_1000.log; table gpu_1000_fp32.log
  echo "== 2. small model, every base task, GPU bf16" | tee -a "$S"
  t small.log $EV --model "$SMALL" --gpu --json "$R/small.json"
  table small.log; seconds "$R/small.json"
  if ls "$(dirname "$SMALL")"/model_*.safetensors > /dev/null 2>&1; then   # the whole run folder was carried
    echo "== 2b. --run: each checkpoint of $(dirname "$SMALL") into eval.csv (GPU bf16)" | tee -a "$S"
    t run.log $EV --run "$(dirname "$SMALL")" --gpu --tasks hellaswag,arc_easy,lambada
    cp "$(dirname "$SMALL")/eval.csv" "$R/eval.csv" && tee -a "$S" < "$R/eval.csv"
  fi
else
  echo "no $SMALL: parts 1 and 2 skipped (carry out/small/best.safetensors)" | tee -a "$S"
fi

echo "== 3. big model, every base task, GPU bf16" | tee -a "$S"
if [ ! -f "$BIG" ]; then
  BIG=/tmp/eval_big_random.safetensors
  echo "no out/big/best.safetensors: a random big model (its tokenizer: 4,096 tokens trained on tinyshakespeare)" | tee -a "$S"
  python - "$BIG" <<'EOF' 2>&1 | tee -a "$S"
import sys
import nanoeuler as ne
tok = ne.Tokenizer.train(open("data/tinyshakespeare.txt").read(), 4096, progress=False)
cfg = ne.PRESETS["big"]
ne.save_model(sys.argv[1], cfg, ne.init_params(cfg), tok)
EOF
fi
t big.log $EV --model "$BIG" --gpu --json "$R/big.json"
table big.log; seconds "$R/big.json"

if [ -f "$SFT" ]; then
  echo "== 4. SFT model, --chat, GPU bf16" | tee -a "$S"
  t sft_arc.log $EV --model "$SFT" --chat --gpu --tasks arc_easy,arc_challenge --json "$R/sft_arc.json"
  table sft_arc.log
  t sft_gsm8k.log $EV --model "$SFT" --chat --gpu --tasks gsm8k --limit 64 --json "$R/sft_gsm8k.json"
  table sft_gsm8k.log
  python - "$R" <<'EOF' | tee -a "$S"
import json, sys
tasks = [t for n in ("sft_arc", "sft_gsm8k") for t in json.load(open(f"{sys.argv[1]}/{n}.json"))["tasks"]]
c = [(t["acc_norm"] - t["chance"]) / (1 - t["chance"]) for t in tasks if t["acc_norm"] is not None]
print(f"ChatCORE-lite over ARC-E, ARC-C (whole) and GSM8K (first 64): {sum(c) / len(c):.4f}")
EOF
else
  echo "no $SFT: part 4 skipped" | tee -a "$S"
fi
