# Sourced by the dev/gpu/*.sh device scripts (not run on its own), from the repository root. Every
# script's first argument is its output folder: $R; the arguments after it stay in "$@". $S, the
# folder's summary.log, begun with the date and the GPU; and four helpers.
export PYTHONUNBUFFERED=1
R=${1:?usage: bash $0 OUTDIR [...] (the folder the logs go to)}; shift
mkdir -p "$R"; S=$R/summary.log; : > "$S"
t() {   # t LOG CMD...: CMD's output into $R/LOG, its wall time and exit code into the summary
  local log=$1; shift
  local s=$EPOCHREALTIME
  "$@" < /dev/null > "$R/$log" 2>&1
  local rc=$?
  echo "[timing] $*: $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s, rc $rc" | tee -a "$S"
}
run_check() {   # nanoeuler_cuda.py check into $R/check.log; its OK and NOT OK lines counted in the summary
  t check.log python nanoeuler_cuda.py check
  echo "check: $(grep -c ' OK$' "$R/check.log") OK, $(grep -c 'NOT OK' "$R/check.log") NOT OK" | tee -a "$S"
  grep "NOT OK" "$R/check.log" | head | tee -a "$S"
}
rows_probe() {   # rows_probe TREE...: dev/variants/decode_rows_probe.py in each tree, into the summary
  for tree in "$@"; do
    echo "== rows probe, $tree" | tee -a "$S"
    (cd "$tree" && python dev/variants/decode_rows_probe.py 2>&1 | tail -6) | tee -a "$S"
  done
}
decode_round() {   # decode_round ROUND TREE...: bench --decode-only (round 1 with --profile) in each tree (main:
  # the repository, else .carry/TREE), the whole output into $R/bench_ROUND.log, its figures into the summary
  local round=$1 tree dir opts; shift
  local keep="tok/s|a pass over [1-4] rows? and 1 head|one step at|prefill|rror|attention_decode|decode_matvec|decode_layers"
  for tree in "$@"; do
    [ "$tree" = main ] && dir=$PWD || dir=$PWD/.carry/$tree
    opts=$([ "$round" = 1 ] && echo --profile)
    echo "== round $round, $tree $opts" | tee -a "$S" >> "$R/bench_$round.log"
    (cd "$dir" && timeout 100 python nanoeuler_cuda.py bench --decode-only $opts > /tmp/b.log 2>&1)
    cat /tmp/b.log >> "$R/bench_$round.log"; grep -E "$keep" /tmp/b.log | tee -a "$S" > /dev/null
  done
}
readme_flow() {   # the README's flow into $L (made by the caller): train big, sft, chat greedy and
  # --speculative (their transcripts in $R), decoding speed on that SFT model; $M: its model
  t train.log python nanoeuler_cuda.py train big --mtp-weight 1.5 --out out/big
  grep -vE "^step |^sample" "$R/train.log" | tail -3 | tee -a "$S"; mv "$R/train.log" "$L/"
  t sft.log python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
  grep -vE "^step |^sample" "$R/sft.log" | tail -3 | tee -a "$S"; mv "$R/sft.log" "$L/"
  M=out/sft/best.safetensors
  printf 'What is the capital of France?\nGive me three tips for staying healthy.\nWhat is a good name for a cat?\n/reset\nWho wrote Romeo and Juliet?\n/quit\n' > /tmp/chat_in.txt
  for mode in greedy spec; do                    # (not through t, which reads /dev/null)
    s=$EPOCHREALTIME
    python nanoeuler_cuda.py chat --model $M --temperature 0 --max-new-tokens 80 $([ $mode = spec ] && echo --speculative) \
      < /tmp/chat_in.txt > "$R/chat_$mode.log" 2>&1
    echo "[timing] chat $mode: $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s" | tee -a "$S"
  done
  cmp -s <(grep -vi specul "$R/chat_greedy.log") <(grep -vi specul "$R/chat_spec.log") && echo "chat: speculative's replies == greedy's" | tee -a "$S"
  t decode_sft.log python nanoeuler_cuda.py bench --decode-only --model $M
  grep -hE "tok/s|prefill" "$R/decode_sft.log" | tee -a "$S"; mv "$R/decode_sft.log" "$L/"
}
launcher_kill() {   # --gpus 1 with its launcher killed (kill -9) mid-run: rank 0 must save and stop on
  # its own, holding --out meanwhile (a second run at once is refused); its log into $L
  python nanoeuler_cuda.py train small --gpus 1 --steps 100000 --eval-every 100000 --save-every 100000 \
    --out out/kill > "$R/kill.log" 2>&1 &
  launcher=$!
  for i in $(seq 600); do grep -qE "^step +100/" "$R/kill.log" && break; sleep 0.1; done
  rank0=$(pgrep -f -n "nanoeuler_cuda.py train small --gpus 1")
  kill -9 $launcher; echo "launcher $launcher killed at: $(grep -E '^step' "$R/kill.log" | tail -1 | cut -c1-40)" | tee -a "$S"
  python nanoeuler_cuda.py train small --steps 2 --resume --out out/kill 2>&1 | tail -1 | sed "s/^/a second run at once: /" | tee -a "$S"
  for i in $(seq 600); do kill -0 $rank0 2>/dev/null || break; sleep 0.1; done
  kill -0 $rank0 2>/dev/null && echo "rank 0 ($rank0) still runs after 60 s" | tee -a "$S"
  grep -E "SIGTERM|saved|error" "$R/kill.log" | tail -3 | sed "s/^/rank 0: /" | tee -a "$S"
  echo "out/kill: $(ls out/kill | tr '\n' ' ')" | tee -a "$S"
  mv "$R/kill.log" "$L/"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee -a "$S"
