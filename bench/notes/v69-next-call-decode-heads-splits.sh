#!/bin/bash
# A device call (v69, second; about 4 min): the several-heads tests of r64 (HEAD: several kv heads a
# tile while their CTAs split at most 64 ways), then 10 cells of few sequences in 256-row pages:
# main (3deabf5, several heads wherever the one-head table is 'decode'), r64, r48 (at most 48
# splits), one (one head everywhere). 5 rounds.
# Prediction: r64 and r48 within 1% of one on batch 1 (128 splits of main lost 2-11%), of main on
# 4 x 128k (33 splits); 2 x 16k (64 splits) and batch-1 two-head cells tell 64 from 48.
# Trees: device_trees.py .device_scratch11 main=3deabf5 r64=HEAD r48=HEAD+bench/notes/v69-decode-heads-most-splits-48.patch
#   one=3deabf5+bench/notes/v69-decode-heads-off.patch --kernels kvcache; carry .device_scratch11.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch11 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
cp tests/test_kvcache_gpu.py $S/r64/tests/
gpu_tests r64 heads_tests 120 tests/test_kvcache_gpu.py -k "kv_heads or splits_few or several_kv_heads"
C=1:16384:32:8:64:paged256,1:131072:32:8:64:paged256,2:16384:32:8:64:paged256,2:131072:32:8:64:paged256
C=$C,1:65536:32:8:64:paged256,4:131072:32:8:64:paged256,4:16384:32:8:64:paged256,1:65536:32:32:128:paged256
C=$C,1:131072:64:8:64:paged256,2:65536:32:8:128:paged256
timeout 300 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/main $S/r64 $S/r48 $S/one \
  2>&1 | tee $OUT/ab.txt | tail -13 >> $L
