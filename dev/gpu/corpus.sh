#!/bin/bash
# The big model on a corpus larger than the embedded one, made from what is at hand
# on a machine with no network: the embedded books and every .py file of the Python
# standard library (code and docstrings; its size depends on the Python: 14.9 MB in all with
# the device's 574 files, 35.7 MB with the 2-core VM's 1,786 in BENCHMARKS' tokenizer table), each file one
# document followed by an <|endoftext|> line, as get_data.sh writes web text. Then
# SFT through an Alpaca-format JSON file made from the embedded instructions (the
# shape of alpaca_data.json, which needs the network). Run from the repository root
# (bash dev/gpu/corpus.sh OUTDIR; OUTDIR: where the logs go). ~4 minutes on an H200.
export PYTHONUNBUFFERED=1
O=${1:?usage: bash dev/gpu/corpus.sh OUTDIR (the folder the logs go to)}; mkdir -p "$O"
C=${CORPUS:-/tmp/corpus}
t() { local s=$EPOCHREALTIME; "$@"; local rc=$?; echo "[timing] $* : $(awk "BEGIN{print $EPOCHREALTIME - $s}") s (rc $rc)"; return $rc; }
python - "$C" <<'PY'
import glob, json, os, shutil, sys, sysconfig
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
for f in glob.glob("data/gutenberg/*.txt"):
    shutil.copy(f, out)
lib = sysconfig.get_paths()["stdlib"]
files = sorted(f for f in glob.glob(os.path.join(lib, "**", "*.py"), recursive=True) if "site-packages" not in f)
n, shard, size = 0, 0, 0
w = open(os.path.join(out, f"stdlib_{shard:03d}.txt"), "w", encoding="utf-8")
for f in files:
    try:
        text = open(f, encoding="utf-8").read()
    except (UnicodeDecodeError, OSError):
        continue
    if "<|endoftext|>" in text:
        continue
    w.write(text.rstrip("\n") + "\n<|endoftext|>\n")
    n, size = n + 1, size + len(text)
    if size > (shard + 1) * 10**7:
        w.close(); shard += 1
        w = open(os.path.join(out, f"stdlib_{shard:03d}.txt"), "w", encoding="utf-8")
w.close()
total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
print(f"corpus {out}: {n} stdlib files and the embedded books, {total / 1e6:.1f} MB")
rows = [json.loads(line) for line in open("data/instructions.jsonl", encoding="utf-8")]
json.dump([{"instruction": r["instruction"], "input": r.get("input", ""), "output": r["response"]} for r in rows],
          open("/tmp/alpaca_like.json", "w"), indent=1)
print(f"/tmp/alpaca_like.json: {len(rows)} examples in Alpaca's format")
PY
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$O/corpus.log"
t python nanoeuler_cuda.py train big --data "$C" --steps 3000 --eval-every 500 --out out/corpus 2>&1 | tee "$O/corpus_train.log" | grep -v "^step " | tail -30 | tee -a "$O/corpus.log"
t python nanoeuler_cuda.py sft --model out/corpus/best.safetensors --data /tmp/alpaca_like.json --out out/corpus_sft 2>&1 | tee "$O/corpus_sft.log" | grep -v "^step " | tail -12 | tee -a "$O/corpus.log"
t python nanoeuler_cuda.py sample --model out/corpus/best.safetensors --prompt "def fibonacci(n):" --temperature 0 --max-new-tokens 80 2>&1 | tee -a "$O/corpus.log"
cp out/corpus/log.csv "$O/corpus_log.csv"
