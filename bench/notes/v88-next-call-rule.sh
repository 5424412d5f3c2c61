#!/bin/bash
# The next session's first call (v88's never came): tree new = HEAD (the consumers' dQ stores under
# the steps rule, _plan.DQ_STORED_STEPS), main = ecc43e6 (before v88); carry [".device_scratch"],
# built by `python bench/device_trees.py .device_scratch main=ecc43e6 new=HEAD`. new's tests of both
# paths, then the kernel time with and without the stores (`always` = the rule). ~3 min cold.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
gpu_tests new new-tests 120 tests/test_smoke.py tests/test_gpu.py -k "smoke or one_key_block or forward_backward"
(cd $S/new && PYTHONPATH=. timeout 90 python $OLDPWD/bench/notes/v87-bwd-kernel-time.py) 2>/dev/null > $OUT/kernel-time.txt
cat $OUT/kernel-time.txt >> $L
cat $L
