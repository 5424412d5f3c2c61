#!/bin/bash
# A device call (v56, second; about 300 s warm): the pair groups of the wgmma LOCAL backward only where
# the grid makes at most 4 waves (v56-bwd-pair-groups.patch as revised after the first call: groups of
# all pairs lost 4-5% on 16-wave grids), the same A/B; then its pair-group GPU tests, and the varlen,
# packed and pair-group tests with the mma.sync family forced (HEAD's 80-row varlen backward changed
# the row kernels and common/mask.cuh that family shares).
# Trees: python bench/device_trees.py .device_scratch main=HEAD pg=HEAD+bench/notes/v56-bwd-pair-groups.patch
# Copy into .device_scratch/ and run as `bash .device_scratch/pg2.sh` (carry .device_scratch).
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
C=128:512:1:2048,256:512:1:2048,64:512:1:2048,128:1024:1:2048,128:512:1:16384,128:1024:1,256:1024:1,128:4096:1,64:1024:1
echo "== ab bwd main pg ($(date +%T))" >> $L
timeout 150 python /tmp/ab.py --pass bwd --rounds 7 --cells $C $S/main $S/pg >> $L 2>&1
echo "== pg: pair-group GPU tests ($(date +%T))" >> $L
(cd $S/pg && PYTHONPATH=. timeout 80 python -m pytest -m gpu -p no:cacheprovider -n 12 -q -p no:warnings \
  tests/test_gpu.py -k "pair_groups" > $OUT/tests_pg.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_pg.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_pg.log | head -10 >> $L
echo "== pg, mma.sync forced: varlen, packed, pair groups ($(date +%T))" >> $L
(cd $S/pg && CUPYFLASH_FAMILY=mma_sync PYTHONPATH=. timeout 200 python -m pytest -m gpu -p no:cacheprovider -n 15 -v -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py -k "varlen or packed or pair_groups" > $OUT/tests_mma.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_mma.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_mma.log | head -10 >> $L
grep -c PASSED $OUT/tests_mma.log >> $L
save_new_kernels
echo "done ($(date +%T))" >> $L
