#!/bin/bash
# decode_pass (one kernel a decoding pass) on one GPU, run from the repository's root; logs into $OUT:
# bench --decode-only --profile on random weights of the big model (decode_pass, then the launches it
# replaces, in the same run); check; the same bench with decode_pass built for one block an SM
# (launch bounds (256, 1): no spills, half the blocks); PyTorch's best decoding (torch.compile with
# CUDA graphs). Each step under a timeout: a grid barrier that never opens would hang the rest.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/decode_pass_out}
mkdir -p "$O"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$O/gpu.log" 2>&1
date -u +%FT%TZ >> "$O/gpu.log"
git log -1 --format=%h 2>/dev/null >> "$O/gpu.log"
timeout 240 python nanoeuler_cuda.py bench --decode-only --profile > "$O/bench.log" 2>&1
echo "bench rc $?"; grep -E "tok/s|a pass over|one step|prefill|same tokens|decoding on|rror" "$O/bench.log"
timeout 200 python nanoeuler_cuda.py check > "$O/check.log" 2>&1
echo "check rc $?"; grep -cE " OK$" "$O/check.log"; grep -E "NOT OK|overall|rror|pass" "$O/check.log" | tail -20
rm -rf /tmp/lb1 && mkdir /tmp/lb1 && cp ./*.py ./*.cu /tmp/lb1/
sed -i 's/__launch_bounds__(256, 2) decode_pass/__launch_bounds__(256, 1) decode_pass/' /tmp/lb1/kernels.cu
(cd /tmp/lb1 && timeout 200 python nanoeuler_cuda.py bench --decode-only --profile > "$O/bench_lb1.log" 2>&1)
echo "lb1 rc $?"; grep -E "tok/s|a pass over|one step|decoding on|rror" "$O/bench_lb1.log"
timeout 240 python3 docs/pytorch_reference.py --decode --compile reduce-overhead > "$O/pytorch.log" 2>&1
echo "pytorch rc $?"; tail -5 "$O/pytorch.log"
