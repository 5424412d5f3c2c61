#!/bin/bash
# Next call (v51; about 200 s of GPU time on a warm machine): the decode's steps as dependent launches
# (v51-decode-dependent-steps.patch) tested and timed, then v50's sweep of the small decode tile.
# Trees in .device_scratch: main = HEAD, pdl = HEAD + v51-decode-dependent-steps.patch, small = HEAD +
# v46-decode-small-tile-for-clusters.experiment.patch (python bench/device_trees.py .device_scratch --kernels kvcache main=HEAD
# pdl=HEAD+bench/notes/v51-decode-dependent-steps.patch small=HEAD+bench/notes/v46-decode-small-tile-for-clusters.experiment.patch).
# Copy into .device_scratch/ and run as `bash .device_scratch/next_call.sh` (carry .device_scratch).
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
echo "== pdl: KV-cache and launch GPU tests ($(date +%T))" >> $L
cd $S/pdl
PYTHONPATH=. timeout 100 python -m pytest -m gpu -p no:cacheprovider -n 12 -v -p no:warnings tests/test_kvcache_gpu.py \
  tests/test_torch_kvcache.py tests/test_launch.py > $OUT/tests_pdl.log 2>&1
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_pdl.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_pdl.log | head -10 >> $L
echo "== pdl: racecheck and memcheck, KV cache only ($(date +%T))" >> $L
PYTHONPATH=. timeout 60 compute-sanitizer --tool racecheck --racecheck-report hazard python tests/sanitize_run.py --kvcache-only 2>&1 | tail -3 >> $L
PYTHONPATH=. timeout 60 compute-sanitizer --tool memcheck python tests/sanitize_run.py --kvcache-only 2>&1 | tail -3 >> $L
cd $S/..
# The lowest cells of v45's grid (steps of 6-14 us), a middle one, two long ones, and one that merges by the combine kernel.
C=1:1024:8:1:64:dense,1:1024:32:8:128:dense,1:1024:32:32:64:paged16,4:4096:8:1:128:dense,16:1024:8:1:64:dense,16:1024:8:1:128:paged16,1:16384:8:1:128:dense,4:1024:32:8:64:paged16,64:1024:8:1:128:paged16,1:16384:8:1:128:paged256,16:16384:32:8:128:dense,128:16384:32:8:64:dense,8:131072:32:8:128:paged256
for kind in bare append between; do
  echo "== ab decode main pdl, $kind steps ($(date +%T))" >> $L
  timeout 80 python /tmp/ab.py --pass decode --decode-step $kind --rounds 5 --cells $C $S/main $S/pdl >> $L 2>&1
done
echo "== v50's sweep: main small ($(date +%T))" >> $L
C=12:1024:8:1:64:dense,16:1024:8:1:64:dense,20:1024:8:1:64:dense,24:1024:8:1:64:dense,28:1024:8:1:64:dense,32:1024:8:1:64:dense,40:1024:8:1:64:dense,48:1024:8:1:64:dense,56:1024:8:1:64:dense,12:2048:8:1:64:dense,16:2048:8:1:64:dense,20:2048:8:1:64:dense,24:2048:8:1:64:dense,28:2048:8:1:64:dense,32:2048:8:1:64:dense,40:2048:8:1:64:dense,48:2048:8:1:64:dense,56:2048:8:1:64:dense,12:3072:8:1:64:dense,16:3072:8:1:64:dense,20:3072:8:1:64:dense,24:3072:8:1:64:dense,28:3072:8:1:64:dense,32:3072:8:1:64:dense,40:3072:8:1:64:dense,48:3072:8:1:64:dense,56:3072:8:1:64:dense,5:1024:32:8:64:dense,6:1024:32:8:64:dense,8:1024:32:8:64:dense,16:1024:8:1:64:paged16,24:1024:8:1:64:paged16,32:1024:8:1:64:paged16,40:1024:8:1:64:paged16,48:1024:8:1:64:paged16,9:1024:8:1:128:dense,12:1024:8:1:128:dense,16:1024:8:1:128:dense,20:1024:8:1:128:dense,24:1024:8:1:128:dense,9:1536:8:1:128:dense,12:1536:8:1:128:dense,16:1536:8:1:128:dense,20:1536:8:1:128:dense,24:1536:8:1:128:dense,9:2048:8:1:128:dense,12:2048:8:1:128:dense,16:2048:8:1:128:dense,20:2048:8:1:128:dense,24:2048:8:1:128:dense,9:1024:8:1:128:paged16,12:1024:8:1:128:paged16,16:1024:8:1:128:paged16,20:1024:8:1:128:paged16,24:1024:8:1:128:paged16
timeout 120 python /tmp/ab.py --pass decode --rounds 7 --cells $C $S/main $S/small >> $L 2>&1
save_new_kernels
echo "done ($(date +%T))" >> $L
