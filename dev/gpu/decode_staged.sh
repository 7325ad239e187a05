#!/bin/bash
# issue 35: decode_matvec with its input rows staged in shared memory once a block (the tree in .carry/stage)
# against main, random weights of big, bf16 (bench --decode-only: rows 1-4 a pass, by kernel); check in the
# staged tree; then main's GPU tests (the day's host changes on the GPU). bash dev/gpu/decode_staged.sh OUTDIR
source dev/gpu/common.sh
decode_round 1 main stage
(cd .carry/stage && timeout 150 python nanoeuler_cuda.py check > "$R/check_stage.log" 2>&1)
echo "check (stage): rc $?, $(grep -c ' OK$' "$R/check_stage.log") OK, $(grep -c 'NOT OK' "$R/check_stage.log") NOT OK" | tee -a "$S"
grep "NOT OK" "$R/check_stage.log" | head | tee -a "$S"
decode_round 2 main stage
t pytest_gpu.log timeout 90 python -m pytest -q -p no:cacheprovider test_cuda_pipeline.py test_async_save.py -k "not emulator"
tail -3 "$R/pytest_gpu.log" | tee -a "$S"
