#!/bin/bash
# s14's first device call: decode_mlp (issue 35) against main; wgmma attention forward and wgmma/TMA products (issue 36)
R=$1; mkdir -p $R; S=$R/summary.log
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $S; date -u | tee -a $S
keep="tok/s|a pass over [1-4] rows? and 1 head|one step at|prefill|rror"
b() { local t0=$SECONDS; (cd $2 && timeout 100 python nanoeuler_cuda.py bench --decode-only > $R/bench_$1.log 2>&1); echo "== $1 ($((SECONDS-t0)) s)" | tee -a $S; grep -E "$keep" $R/bench_$1.log | tee -a $S; }
b main1 . ; b mlp1 .carry/mlp
t0=$SECONDS; timeout 90 python dev/variants/attention_forward_wgmma.py > $R/attn_wgmma.log 2>&1; echo "attn rc $? ($((SECONDS-t0)) s)" | tee -a $S
tail -40 $R/attn_wgmma.log >> $S
t0=$SECONDS; timeout 90 python dev/variants/wgmma_probe.py > $R/wgmma_probe.log 2>&1; echo "probe rc $? ($((SECONDS-t0)) s)" | tee -a $S
tail -45 $R/wgmma_probe.log >> $S
t0=$SECONDS; (cd .carry/mlp && timeout 150 python nanoeuler_cuda.py check > $R/check_mlp.log 2>&1; echo "check mlp rc $? ($((SECONDS-t0)) s): $(grep -c ' OK$' $R/check_mlp.log) OK, $(grep -c 'NOT OK' $R/check_mlp.log) NOT OK" | tee -a $S; grep -E "NOT OK|rror" $R/check_mlp.log | head -8 | tee -a $S)
b mlp2 .carry/mlp; b main2 .
