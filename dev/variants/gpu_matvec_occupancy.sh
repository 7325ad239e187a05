#!/bin/bash
# decode_matvec built for 3 and 4 blocks an SM instead of 2 (launch bounds (256, 3) / (256, 4): at most
# 85 / 64 registers), so that with programmatic launch the next product's blocks fit beside the last
# one's and start their weight loads early: dev/variants/decode_probe.py in the tree and in each copy,
# then check in each copy. Run from the root; logs into $OUT.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/matvec_occupancy}
mkdir -p "$O"
echo "== base"; timeout 90 python dev/variants/decode_probe.py 2>&1 | tee "$O/probe_base.log"
for n in 3 4; do
  rm -rf "/tmp/lb$n" && mkdir -p "/tmp/lb$n/dev/variants" && cp ./*.py ./*.cu "/tmp/lb$n/" && cp dev/variants/*.py "/tmp/lb$n/dev/variants/"
  sed -i "s/__launch_bounds__(256, 2) decode_matvec/__launch_bounds__(256, $n) decode_matvec/" "/tmp/lb$n/kernels.cu"
  echo "== lb$n"; (cd "/tmp/lb$n" && timeout 90 python dev/variants/decode_probe.py 2>&1) | tee "$O/probe_lb$n.log"
done
for n in 3 4; do
  (cd "/tmp/lb$n" && timeout 60 python nanoeuler_cuda.py check > "$O/check_lb$n.log" 2>&1)
  echo "check lb$n rc $?: $(grep -cE ' OK$' "$O/check_lb$n.log") OK, $(grep -E 'overall' "$O/check_lb$n.log")"
done
