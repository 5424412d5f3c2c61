#!/bin/bash
# A device call (v69, third; about 9 min): HEAD's KV-cache GPU files (the split-rows rule, its
# tests), the rule's A/B on 14 cells (heads4: 3deabf5, v68's rule; new: HEAD; one: one kv head a
# tile everywhere), 5 rounds, then the first third of the default family's GPU suite.
# Prediction: new within 1% of the better of heads4 and one in every cell: one's on few sequences
# in 256-row pages but 2 and 4 x 128k, heads4's there and on the long dense cells.
# Trees: device_trees.py .device_scratch13 heads4=3deabf5 new=HEAD one=3deabf5+bench/notes/v69-decode-heads-off.patch
#   --kernels kvcache; .device_scratch12 (`--kernels all --named bench/device-test-kernels.txt` of
#   HEAD~1) for the suite's kernels; carry both.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch13 source bench/device_call.sh
tar -xJf .device_scratch12/cache.tar.xz -C /tmp/pcache --strip-components=1
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests new kvcache_tests 150 tests/test_kvcache_gpu.py tests/test_torch_kvcache.py
C=1:16384:32:8:64:paged256,1:131072:32:8:64:paged256,2:16384:32:8:64:paged256,2:131072:32:8:64:paged256
C=$C,1:65536:32:8:64:paged256,4:131072:32:8:64:paged256,4:16384:32:8:64:paged256,1:65536:32:32:128:paged256
C=$C,1:131072:64:8:64:paged256,2:65536:32:8:128:paged256,64:131072:32:8:64:dense,128:8192:32:8:64:dense
C=$C,16:131072:32:32:64:dense,16:131072:32:8:64:paged256
timeout 170 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/heads4 $S/new $S/one \
  2>&1 | tee $OUT/ab.txt | tail -17 >> $L
(PYTHONPATH=. timeout 230 python bench/gpu_suite.py --part 1/3 -- -n 15 -q -rf -p no:cacheprovider -p no:warnings \
  > $OUT/suite1.log 2>&1); echo "suite 1/3 rc $? ($(date +%T))" >> $L
tail -1 $OUT/suite1.log >> $L; grep -E "^FAILED|^ERROR" $OUT/suite1.log | head >> $L
