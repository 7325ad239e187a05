#!/bin/bash
# The weights a layer ahead in L2 (issue 35; the diff's kernels.cu l2_ahead), in one call, about 3 minutes
# on an H100: in a copy of main with the diff applied (patch -p1 < dev/variants/decode_l2_ahead.diff),
# bash dev/variants/gpu_l2_ahead.sh OUTDIR. check; bench --decode-only on random weights of big in that
# tree and in two copies made here (off: DECODE_AHEAD = False, the code before; lead8: two layers ahead),
# two rounds, the first with --profile and --decode-variants (without L2 ahead in the same process);
# the README flow's model (train big --mtp-weight 1.5, sft) and bench --decode-only on it in the three
# trees; PyTorch's best decoding. Logs of 2026-12-05 19:10 UTC: dev/logs/2026-12-05_h100_l2_ahead/.
source "$(dirname "$0")/../gpu/common.sh"
keep="tok/s|a pass over 1 row and 1 head|a pass over 2 rows and 1 head|a pass over 4 rows and 1 head|one step at position 17|prefill|same tokens|rror"
for copy in off lead8; do rm -rf /tmp/$copy; mkdir /tmp/$copy; cp nanoeuler.py nanoeuler_cuda.py *.cu /tmp/$copy/; done
sed -i 's/^DECODE_AHEAD = True/DECODE_AHEAD = False/' /tmp/off/nanoeuler_cuda.py
sed -i 's/order\[4:\] + order\[:4\]/order[8:] + order[:8]/' /tmp/lead8/nanoeuler_cuda.py
echo "copies: off $(grep -c '^DECODE_AHEAD = False' /tmp/off/nanoeuler_cuda.py), lead8 $(grep -c 'order\[8:\]' /tmp/lead8/nanoeuler_cuda.py)" | tee -a "$S"
run_check
grep -E "L2 ahead|without PDL" "$R/check.log" | tee -a "$S"
here=$PWD
for round in 1 2; do for tree in $here /tmp/off /tmp/lead8; do
  opts=$([ $round = 1 ] && echo "--profile")$([ $round = 1 ] && [ $tree = $here ] && echo " --decode-variants")
  echo "== random weights, round $round, $tree $opts" | tee -a "$S"
  log="$R/bench_random_${round}_$(basename $tree).log"
  (cd $tree && timeout 120 python nanoeuler_cuda.py bench --decode-only $opts > "$log" 2>&1)
  grep -E "$keep" "$log" | grep -v "^    [a-z_]" | tee -a "$S"
done; done
t train.log python nanoeuler_cuda.py train big --mtp-weight 1.5 --out out/big
grep -vE "^step |^sample" "$R/train.log" | tail -3 | head -1 | tee -a "$S"
t sft.log python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft
grep -vE "^step |^sample" "$R/sft.log" | tail -3 | head -1 | tee -a "$S"
M=$here/out/sft/best.safetensors
for tree in $here /tmp/off /tmp/lead8; do
  echo "== flow's SFT model (--mtp-weight 1.5), $tree" | tee -a "$S"
  log="$R/bench_flow_$(basename $tree).log"
  (cd $tree && timeout 60 python nanoeuler_cuda.py bench --decode-only --model $M > "$log" 2>&1)
  grep -E "$keep" "$log" | tee -a "$S"
done
t torch_decode.log timeout 150 python tools/pytorch_reference.py --decode --compile reduce-overhead
tail -1 "$R/torch_decode.log" | tee -a "$S"
