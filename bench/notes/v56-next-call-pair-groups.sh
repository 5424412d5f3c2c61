#!/bin/bash
# A device call (v56; about 420 s warm): the wgmma LOCAL backward's grid in groups of (batch entry,
# kv head) pairs (v56-bwd-pair-groups.patch; modelled 1.31-1.33x on 4 x 512 causal at hd128 and
# hd256, 1.025x at 32 x 512, the 16k-token 1k-4k cells unchanged): the backward A/B on short causal
# calls and grid cells, then the causal, window and LOCAL GPU tests of test_gpu.py, and memcheck.
# Trees: python bench/device_trees.py .device_scratch main=HEAD pg=HEAD+bench/notes/v56-bwd-pair-groups.patch
# Copy into .device_scratch/ and run as `bash .device_scratch/pg.sh` (carry .device_scratch).
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
C=128:512:1:2048,256:512:1:2048,64:512:1:2048,128:1024:1:2048,128:512:1:16384,128:1024:1,256:1024:1,128:4096:1,64:1024:1
echo "== ab bwd main pg ($(date +%T))" >> $L
timeout 150 python /tmp/ab.py --pass bwd --rounds 5 --cells $C $S/main $S/pg >> $L 2>&1
echo "== pg: causal, window and LOCAL GPU tests ($(date +%T))" >> $L
(cd $S/pg && PYTHONPATH=. timeout 230 python -m pytest -m gpu -p no:cacheprovider -n 15 -v -p no:warnings \
  tests/test_gpu.py -k "pair_groups or causal or window or local" > $OUT/tests_pg.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_pg.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_pg.log | head -10 >> $L
grep -c PASSED $OUT/tests_pg.log >> $L
(cd $S/pg && PYTHONPATH=. timeout 90 compute-sanitizer --tool memcheck python tests/sanitize_run.py 2>&1 | tail -1 >> $L)
save_new_kernels
echo "done ($(date +%T))" >> $L
