#!/bin/bash
# A device call (v68; about 9 min): the decode tile of several kv heads (kvheads branch, `new`)
# against main: the KV-cache GPU tests on new's tree, then (if they pass) memcheck of the KV-cache
# cases and 21 decode cells, 5 rounds, trees alternated twice. Prediction (v68's spans call: 2-4
# heads' 128-byte rows a CTA stream at 3.12-3.16 TB/s against one head's 3.07-3.08 at full
# occupancy): hd64 dense and paged256 GQA/MHA cells +1.5-2.5%; hd128 (two heads, 512-byte runs)
# within 1% (its one-head rows already stream at 3.15); short hd64 cells on the 4-warp tile at risk
# (108 registers: four CTAs an SM instead of five); MQA controls unchanged.
# Trees: device_trees.py .device_scratch9 main=main new=kvheads --kernels kvcache; carry .device_scratch9.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch9 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests new kvcache_tests 170 tests/test_kvcache_gpu.py tests/test_torch_kvcache.py
if grep -q "^rc 0" $L; then
  (cd $S/new && PYTHONPATH=. timeout 80 compute-sanitizer --tool memcheck python tests/sanitize_run.py --kvcache-only \
    > $OUT/memcheck.log 2>&1); echo "memcheck rc $?" >> $L; tail -2 $OUT/memcheck.log >> $L
  C=64:131072:32:8:64:dense,16:131072:32:32:64:dense,128:65536:32:8:64:dense,128:8192:32:8:64:dense
  C=$C,1:131072:32:8:64:dense,1:4096:32:8:64:dense,16:1024:32:8:64:dense,128:1024:32:8:64:dense
  C=$C,1:131072:32:8:64:paged16,16:16384:32:8:64:paged16,4:4096:32:8:64:paged16,16:2048:32:8:64:paged16
  C=$C,16:131072:32:8:64:paged256,16:1024:8:1:64:paged256,16:65536:32:8:128:dense,64:65536:32:8:128:dense
  C=$C,128:1024:32:8:128:dense,16:16384:32:8:128:paged16,8:131072:32:8:128:paged256,1:16384:8:1:128:dense
  C=$C,128:131072:8:1:64:dense
  timeout 320 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/main $S/new $S/main $S/new 2>&1 | tail -26 >> $L
fi
save_new_kernels
