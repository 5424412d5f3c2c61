#!/bin/bash
# A device call (v68; about 4 min): several kv heads as a compile-time twin (`_kvheads` kernels),
# one-head kernels back to main's code: the KV-cache GPU tests, then 8 cells, 3 rounds. Prediction:
# the short cells (one head) within noise of main (-kvheads3's -1.5 to -3.7% came from the runtime
# shift in every kernel); the 'decode' cells' gains as before (+1.2-2.5%).
# Trees: device_trees.py .device_scratch9 main=main new=kvheads --kernels kvcache; carry .device_scratch9.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch9 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests new kvcache_tests 170 tests/test_kvcache_gpu.py tests/test_torch_kvcache.py
C=1:4096:32:8:64:dense,16:1024:32:8:64:dense,128:1024:32:8:128:dense,4:16384:32:8:64:dense
C=$C,64:131072:32:8:64:dense,4:131072:32:8:64:paged256,64:65536:32:8:128:dense,16:131072:32:32:64:dense
timeout 150 python /tmp/ab.py --pass decode --rounds 3 --cells $C $S/main $S/new $S/main $S/new 2>&1 | tee $OUT/ab.txt | tail -12 >> $L
save_new_kernels
