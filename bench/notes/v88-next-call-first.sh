#!/bin/bash
# The next session's first call for v88's dQ stores: carry [".device_scratch"], built by
# `python bench/device_trees.py .device_scratch main=HEAD new=HEAD+bench/notes/v88-consumers-store-dq.patch`.
# First the two files where v88's call 5 saw one unnamed failure, with the patch (new) and, where
# one fails, without (main); then the one-key-block cases of both families and the kernel time with
# and without the stores (`always` = the rule). ~4 min cold.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
gpu_tests new jax-graphs-new 150 tests/test_jax_gpu.py tests/test_graphs.py
if grep -q "^FAILED" $OUT/jax-graphs-new.log; then
  gpu_tests main jax-graphs-main 150 $(grep "^FAILED" $OUT/jax-graphs-new.log | sed -E 's/^FAILED ([^ ]+).*/\1/' | sort -u)
fi
gpu_tests new one-key-block 100 tests/test_gpu.py tests/test_smoke.py -k "one_key_block or smoke"
(cd $S/new && PYTHONPATH=. timeout 75 python $OLDPWD/bench/notes/v87-bwd-kernel-time.py) 2>/dev/null > $OUT/kernel-time.txt
cat $OUT/kernel-time.txt >> $L
save_new_kernels
cat $L
