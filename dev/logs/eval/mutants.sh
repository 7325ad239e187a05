# Each line of MUTANTS is a sed expression: a plausible bug put into a copy of tools/eval.py;
# test_eval.py must fail on every one. Run from the repository root: bash dev/logs/eval/mutants.sh
MUTANTS=(
  's/z = logits\[i, len(inp) - n:len(inp)\]/z = logits[i, len(inp) - n - 1:len(inp) - 1]/'   # logits read one place early
  's/t = np.array(tgt\[-n:\])/t = np.array(inp[-n:])/'                                       # targets = inputs (off by one)
  's/return -nll.sum(), -nll.mean()/return -nll.sum(), -nll.sum()/'                          # acc_norm by the sum
  's/for _, c, x in sorted(item.pop("rows"))/for _, c, x in item.pop("rows")/'               # choices in file order, not idx
  's/full = (list(ctx_ids) + list(cont_ids))\[-(T + 1):\]/full = (list(ctx_ids) + list(cont_ids))[-T:]/'   # cut one too many
  's/pick_norm == it\["gold"\]/pick == it["gold"]/'                                           # acc_norm counts acc's pick
  's/        if r\["doc_id"\] >= UNCONDITIONED:/        if r["doc_id"] > UNCONDITIONED:/'       # an unconditioned copy kept
  's/targets\[i, len(inp) - n:len(inp), 0\] = tgt\[-n:\]/targets[i, len(inp) - n - 1:len(inp) - 1, 0] = tgt[-n:]/'   # GPU: targets a place early
  's/n_bytes += len(it\["pairs"\]\[0\]\[1\].encode("utf-8"))/n_bytes += len(it["pairs"][0][1].strip().encode("utf-8"))/'  # bpb without the space
)
cp tools/eval.py /tmp/eval.py.orig
trap 'cp /tmp/eval.py.orig tools/eval.py' EXIT
for m in "${MUTANTS[@]}"; do
  cp /tmp/eval.py.orig tools/eval.py
  sed -i "$m" tools/eval.py
  if cmp -s tools/eval.py /tmp/eval.py.orig; then echo "NOT APPLIED: $m"; continue; fi
  if python -m pytest -q -x test_eval.py > /dev/null 2>&1; then echo "SURVIVED: $m"; else echo "killed: $m"; fi
done
