#!/bin/bash
# v88's call for the wgmma backward storing dQ from its consumers' registers where the keys are one
# block (and the folded softcap backward, both in tree `new`; `main` is HEAD). Carry
# [".device_scratch"], built by `python bench/device_trees.py .device_scratch main=HEAD
# new=HEAD+bench/notes/v88-stores-dq-softcap.patch`. In order of what decides: new's GPU tests
# (the one-key-block cases in both families, smoke, test_forward_backward, softcap), its backward
# kernel time with and without the store, host A/B pairs main/new.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
gpu_tests new new-tests 200 tests/test_smoke.py tests/test_gpu.py -k "smoke or one_key_block or forward_backward or softcap"
(cd $S/new && PYTHONPATH=. timeout 120 python $OLDPWD/bench/notes/v87-bwd-kernel-time.py) > $OUT/kernel-time.txt 2>&1
cat $OUT/kernel-time.txt >> $L
for round in 1; do
  for tree in main new; do
    PYTHONPATH=$S/$tree timeout 60 python bench/notes/v86-host-ab.py $tree >> $OUT/ab.txt 2>/dev/null
  done
done
sort -k2,4 -s $OUT/ab.txt >> $L
save_new_kernels
cat $L
