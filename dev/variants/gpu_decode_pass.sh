#!/bin/bash
# decode_pass (dev/variants/decode_pass.diff applied) on one GPU, run from the root; logs into $OUT:
# bench --decode-only --profile on random weights of the big model (decode_pass, then the launches it
# replaces, in the same run); check; two variants in copies of the tree, bench --profile without the
# launches' reference: decode_pass built for one block an SM (launch bounds (256, 1): no spills, half
# the blocks), and a waiting block sleeping 32 ns between reads of the barrier's count; PyTorch's best
# decoding (torch.compile with CUDA graphs). Each step under a timeout: a barrier that never opens
# would hang the rest.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/decode_pass_out}
mkdir -p "$O"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$O/gpu.log" 2>&1
date -u +%FT%TZ >> "$O/gpu.log"
keep="tok/s|a pass over|one step|prefill|same tokens|decoding on|rror"
timeout 240 python nanoeuler_cuda.py bench --decode-only --profile > "$O/bench.log" 2>&1
echo "bench rc $?"; grep -E "$keep" "$O/bench.log"
timeout 200 python nanoeuler_cuda.py check > "$O/check.log" 2>&1
echo "check rc $?"; grep -cE " OK$" "$O/check.log"; grep -E "NOT OK|overall|rror|one by one" "$O/check.log" | tail -12
variant() {                                    # variant NAME SED-EXPRESSION: bench --profile in a copy
  rm -rf "/tmp/$1" && mkdir "/tmp/$1" && cp ./*.py ./*.cu "/tmp/$1/"
  sed -i "$2" "/tmp/$1/kernels.cu"
  sed -i 's/^        if dec.fused:  .*# the same-run reference.*/        if False:/' "/tmp/$1/nanoeuler_cuda.py"
  (cd "/tmp/$1" && timeout 150 python nanoeuler_cuda.py bench --decode-only --profile > "$O/bench_$1.log" 2>&1)
  echo "$1 rc $?"; grep -E "$keep" "$O/bench_$1.log"
}
variant lb1 's/__launch_bounds__(256, 2) decode_pass/__launch_bounds__(256, 1) decode_pass/'
variant sleep32 's/^#define PASS_SPIN_SLEEP 0 /#define PASS_SPIN_SLEEP 32 /'
timeout 240 python3 docs/pytorch_reference.py --decode --compile reduce-overhead > "$O/pytorch.log" 2>&1
echo "pytorch rc $?"; tail -2 "$O/pytorch.log"
