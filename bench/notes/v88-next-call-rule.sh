#!/bin/bash
# v88's last call: tree new = the consumers' dQ stores under the steps rule (_plan.DQ_STORED_STEPS)
# and the folded softcap backward; its tests of both paths, then the kernel time with and without.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
gpu_tests new new-tests 120 tests/test_smoke.py tests/test_gpu.py -k "smoke or one_key_block or forward_backward"
(cd $S/new && PYTHONPATH=. timeout 90 python $OLDPWD/bench/notes/v87-bwd-kernel-time.py) 2>/dev/null > $OUT/kernel-time.txt
cat $OUT/kernel-time.txt >> $L
cat $L
