# Sourced by the docs/gpu_*.sh device scripts (not run on its own): $R, the output folder ($OUT);
# $S, its summary.log, begun with the date and the GPU; and three helpers.
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"; S=$R/summary.log; : > "$S"
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
rows_probe() {   # rows_probe TREE...: docs/variants/decode_rows_probe.py in each tree, into the summary
  for tree in "$@"; do
    echo "== rows probe, $tree" | tee -a "$S"
    (cd "$tree" && python docs/variants/decode_rows_probe.py 2>&1 | tail -6) | tee -a "$S"
  done
}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee -a "$S"
