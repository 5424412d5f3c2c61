#!/bin/bash
# A device call (v67; about 7 min): hd64's dense decode tile on 4 stages and long paged caches split
# for at most two CTAs per SM (HEAD) against HEAD~1: first the KV-cache GPU tests on HEAD's tree,
# then 17 decode cells, 5 rounds, the trees alternated twice. Prediction (from -ring.sh and
# -ring2.sh's sweeps): hd64 dense cells served by the 'decode' table +1-2.5%, hd64 16-row pages of
# 16k-128k rows +1-3%, 2k-4k pages (not swept) within 2%.
# Trees: device_trees.py .device_scratch9 main=HEAD~1 new=HEAD --kernels kvcache; carry .device_scratch9.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch9 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests new kvcache_tests 150 tests/test_kvcache_gpu.py tests/test_torch_kvcache.py
C=1:131072:32:8:64:dense,16:16384:32:8:64:dense,16:131072:32:8:64:dense,64:131072:32:8:64:dense
C=$C,128:8192:32:8:64:dense,4:65536:32:8:64:dense,1:131072:32:8:64:paged16,4:65536:32:8:64:paged16
C=$C,16:131072:32:8:64:paged16,16:16384:32:8:64:paged16,4:4096:32:8:64:paged16,16:2048:32:8:64:paged16
C=$C,64:4096:32:8:64:paged16,1:131072:32:8:64:paged256,16:131072:32:8:64:paged256,8:131072:32:8:128:paged16
C=$C,64:16384:32:8:128:paged16
timeout 400 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/main $S/new $S/main $S/new 2>&1 | tail -20 >> $L
save_new_kernels
