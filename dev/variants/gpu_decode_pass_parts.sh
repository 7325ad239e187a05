#!/bin/bash
# Where decode_pass's time goes (dev/variants/decode_pass.diff applied; run from the root; logs into $OUT): the probe
# in the tree, then in two timing-only copies: the barriers alone (no stage has work), and the stages
# without the barriers (no block waits for another: wrong logits, the stages' own time)
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/decode_pass_parts}
mkdir -p "$O"
timeout 120 python dev/variants/decode_pass_probe.py 2>&1 | tee "$O/probe.log"
variant() {                                    # variant NAME SED-EXPRESSION...: the probe in a copy
  local name=$1; shift
  rm -rf "/tmp/$name" && mkdir -p "/tmp/$name/dev/variants" && cp ./*.py ./*.cu "/tmp/$name/" && cp dev/variants/*.py "/tmp/$name/dev/variants/"
  for e in "$@"; do sed -i "$e" "/tmp/$name/kernels.cu"; done
  echo "== $name"; (cd "/tmp/$name" && timeout 120 python dev/variants/decode_pass_probe.py 2>&1 | head -1) | tee "$O/probe_$name.log"
}
variant barriers_only 's/for (int vb = blockIdx.x; vb < blocks; vb += gridDim.x) {/for (int vb = blockIdx.x; vb < 0; vb += gridDim.x) {/'
variant no_barriers '/red.release.gpu.global.add.u64/d' 's/            pass_wait(arrived, target);/            __syncthreads();/'
