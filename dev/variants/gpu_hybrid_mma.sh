# bash dev/variants/gpu_hybrid_mma.sh OUTDIR: the hybrid tensor-core decode product against the kept
# code (dev/LOG.md, evening of 2026-12-02);
# ab_x made by hand first: mkdir ab_x && git archive HEAD | tar -x -C ab_x &&
# git apply --directory=ab_x dev/variants/decode_matvec_tensor_cores_hybrid.diff
pip install -q -r requirements-cuda.txt > /dev/null 2>&1
source dev/gpu/common.sh
(cd ab_x && python nanoeuler_cuda.py check > $R/check_ab_x.log 2>&1); echo "check ab_x: $(grep -c ' OK$' $R/check_ab_x.log) OK, $(grep -c 'NOT OK' $R/check_ab_x.log) NOT OK" | tee -a $S; grep "NOT OK" $R/check_ab_x.log | head | tee -a $S
rows_probe . ab_x
python nanoeuler_cuda.py train big --steps 600 --out out/big > "$R/train.log" 2>&1
python nanoeuler_cuda.py sft --model out/big/best.safetensors --out out/sft > "$R/sft.log" 2>&1
M=$PWD/out/sft/best.safetensors
for round in 1 2; do for tree in . ab_x; do
  echo "== SFT model, $tree" | tee -a "$S"
  (cd $tree && python nanoeuler_cuda.py bench --decode-only --model $M 2>&1) | grep -E "tok/s|prefill|rror" | tee -a "$S"
done; done
(cd ab_x && python dev/variants/draft_ranks.py $M 2>&1 | head -2) | tee -a $S
cd $R && tar czf logs.tgz *.log && rm -f check_ab_x.log train.log sft.log
