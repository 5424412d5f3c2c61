#!/bin/bash
# A device call (v68; about 6 min): the rule of several kv heads narrowed to calls whose one-head
# table is 'decode' (more CTAs than SMs or large pages, long caches): the KV-cache GPU tests, then
# 21 cells. Prediction: the few-CTA dense cells now one head, within 1% of main (-kvheads2.sh read
# them -0.7 to -2% with heads); the 'decode' cells +1-3% as before; hd128 of many CTAs (two heads, not
# yet timed beside main at 512-1024 CTAs) within 1%.
# Trees: device_trees.py .device_scratch9 main=main new=kvheads --kernels kvcache; carry .device_scratch9.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch9 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests new kvcache_tests 170 tests/test_kvcache_gpu.py tests/test_torch_kvcache.py
C=1:131072:32:8:64:dense,4:16384:32:8:64:dense,2:65536:32:8:64:dense,8:32768:32:8:64:dense
C=$C,1:4096:32:8:64:dense,16:1024:32:8:64:dense,4:16384:32:8:128:dense,16:65536:32:8:128:dense
C=$C,128:1024:32:8:128:dense,64:131072:32:8:64:dense,128:8192:32:8:64:dense,32:16384:32:8:64:dense
C=$C,16:131072:32:32:64:dense,16:131072:32:8:64:paged256,4:131072:32:8:64:paged256
C=$C,8:131072:32:8:128:paged256,128:65536:32:8:128:dense,64:65536:32:8:128:dense,16:65536:32:32:128:dense
C=$C,16:16384:32:8:64:paged16,128:131072:8:1:64:dense
timeout 300 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/main $S/new $S/main $S/new 2>&1 | tail -25 >> $L
save_new_kernels
