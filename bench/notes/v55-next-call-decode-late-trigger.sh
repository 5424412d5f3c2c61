#!/bin/bash
# A device call (v55; about 300 s warm): the KV-cache kernels as dependent launches with the decode's
# trigger after its main loop and none in the combine (v55-decode-dependent-steps-late-trigger.patch),
# against HEAD and v51's trigger-at-start patch, which lost 11% in one cell (bench/notes/v55): the
# KV-cache GPU tests and both sanitizers in late, then the v51 call's 13 cells in three kinds of
# steps, 9 rounds. Trees: python bench/device_trees.py .device_scratch --kernels kvcache main=HEAD
# pdl=HEAD+bench/notes/v51-decode-dependent-steps.patch late=HEAD+bench/notes/v55-decode-dependent-steps-late-trigger.patch
# Copy into .device_scratch/ and run as `bash .device_scratch/late.sh` (carry .device_scratch).
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
echo "== late: KV-cache and launch GPU tests ($(date +%T))" >> $L
(cd $S/late && PYTHONPATH=. timeout 100 python -m pytest -m gpu -p no:cacheprovider -n 12 -q -p no:warnings \
  tests/test_kvcache_gpu.py tests/test_torch_kvcache.py tests/test_launch.py > $OUT/tests_late.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_late.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_late.log | head -10 >> $L
(cd $S/late && PYTHONPATH=. timeout 60 compute-sanitizer --tool racecheck --racecheck-report hazard python tests/sanitize_run.py --kvcache-only 2>&1 | tail -1 >> $L)
(cd $S/late && PYTHONPATH=. timeout 60 compute-sanitizer --tool memcheck python tests/sanitize_run.py --kvcache-only 2>&1 | tail -1 >> $L)
C=1:1024:8:1:64:dense,1:1024:32:8:128:dense,1:1024:32:32:64:paged16,4:4096:8:1:128:dense,16:1024:8:1:64:dense,16:1024:8:1:128:paged16,1:16384:8:1:128:dense,4:1024:32:8:64:paged16,64:1024:8:1:128:paged16,1:16384:8:1:128:paged256,16:16384:32:8:128:dense,128:16384:32:8:64:dense,8:131072:32:8:128:paged256
for kind in bare append between; do
  echo "== ab decode main pdl late, $kind steps ($(date +%T))" >> $L
  timeout 100 python /tmp/ab.py --pass decode --decode-step $kind --rounds 9 --cells $C $S/main $S/pdl $S/late >> $L 2>&1
done
save_new_kernels
echo "done ($(date +%T))" >> $L
