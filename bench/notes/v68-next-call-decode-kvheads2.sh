#!/bin/bash
# A device call (v68; about 8 min): v68-next-call-decode-kvheads.sh again after the rule took several
# kv heads only on long caches (dense or in pages of 256+ rows): the KV-cache GPU tests (new ones:
# options and splits on such tiles), then 24 cells. Prediction: the long cells' gains of the first
# call stay (+4-6% hd64 dense and paged256); the short and small-page cells now run one head, as main
# does, on the new kernel: within 1% (the copy step is 12 instructions shorter, but the 4-warp
# tile's 108 registers hold four CTAs an SM, main's 95 five).
# Trees: device_trees.py .device_scratch9 main=main new=kvheads --kernels kvcache; carry .device_scratch9.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch9 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests new kvcache_tests 170 tests/test_kvcache_gpu.py tests/test_torch_kvcache.py
C=64:131072:32:8:64:dense,128:8192:32:8:64:dense,1:131072:32:8:64:dense,4:16384:32:8:64:dense
C=$C,8:32768:32:8:64:dense,2:65536:32:8:64:dense,1:4096:32:8:64:dense,16:1024:32:8:64:dense
C=$C,128:1024:32:8:64:dense,32:2048:32:8:64:dense,1:131072:32:8:64:paged16,16:16384:32:8:64:paged16
C=$C,16:2048:32:8:64:paged16,64:4096:32:8:64:paged16,16:131072:32:8:64:paged256,4:131072:32:8:64:paged256
C=$C,16:65536:32:8:128:dense,32:8192:32:8:128:dense,4:16384:32:8:128:dense,128:1024:32:8:128:dense
C=$C,16:16384:32:8:128:paged16,8:131072:32:8:128:paged256,16:1024:8:1:64:paged256,128:131072:8:1:64:dense
timeout 330 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/main $S/new $S/main $S/new 2>&1 | tail -28 >> $L
save_new_kernels
