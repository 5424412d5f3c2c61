#!/bin/bash
# The next session's first call (~6 min cold): carry [".device_scratch"], built by
#   python bench/device_trees.py .device_scratch main=HEAD new=HEAD+bench/notes/v89-dq-16-byte-stores.patch \
#     before=8c52c22 --named bench/notes/v89-test-kernels.txt
# (main: v89's landed dQ stores, 4-byte pairs; new: the same in 16-byte rows; before: no stores).
# 1. new's one-key-block and smoke cases (both families); 2. the backward kernels' time a fwd+bwd in
# main and new, never / rule / one-block (the stores' cost a step, which sets DQ_STORED_STEPS);
# 3. issue 18's host A/B, before against main, two rounds of one process each (v86-host-ab.py: read
# it only where SDPA's columns look quiet: small fwd ~18 us, medium fwd+bwd ~137 us).
cd "$(dirname "$0")/../.."
source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
gpu_tests new one-key-block 150 -x tests/test_gpu.py tests/test_smoke.py -k "one_key_block or smoke"
for tree in main new; do
  echo "== $tree" >> $OUT/kernel-time.txt
  (cd $S/$tree && PYTHONPATH=. timeout 100 python $OLDPWD/bench/notes/v89-bwd-kernel-time.py) >> $OUT/kernel-time.txt 2>/dev/null
done
cat $OUT/kernel-time.txt >> $L
host_ab 2 before main
save_new_kernels
cat $L
