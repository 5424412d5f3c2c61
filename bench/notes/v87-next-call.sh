#!/bin/bash
# The next session's first call for v87's two patches (trees and kernels in .device_scratch, built
# by `python bench/device_trees.py .device_scratch main=HEAD dq=HEAD+bench/notes/v87-wgmma-stores-dq.patch
# softcap=HEAD+bench/notes/v87-wgmma-softcap-backward-folded.patch --options '{"softcap": 30.0}'`;
# carry [".device_scratch"]). In order of what decides: the dq patch's GPU tests (its own cases,
# the smoke tier, test_forward_backward), its backward kernel time with and without the store, the
# softcap patch's backward A/B against main, then one host A/B pair main/dq. ~6 min cold.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
gpu_tests dq dq-tests 150 tests/test_smoke.py tests/test_gpu.py -k "smoke or one_key_block or forward_backward"
(cd $S/dq && PYTHONPATH=. timeout 90 python $OLDPWD/bench/notes/v87-bwd-kernel-time.py) > $OUT/kernel-time.txt 2>/dev/null
cat $OUT/kernel-time.txt >> $L
timeout 150 python /tmp/ab.py --pass bwd --options '{"softcap": 30.0}' --rounds 3 $S/main $S/softcap >> $L 2>&1
(cd $S/softcap && PYTHONPATH=. timeout 60 python -m pytest -p no:cacheprovider -q -n 15 tests/test_gpu.py -k "softcap") \
  > $OUT/softcap-tests.log 2>&1; tail -1 $OUT/softcap-tests.log >> $L
for tree in main dq; do
  PYTHONPATH=$S/$tree timeout 60 python bench/notes/v86-host-ab.py $tree >> $OUT/ab.txt 2>/dev/null
done
sort -k2,4 -s $OUT/ab.txt >> $L
save_new_kernels
cat $L
