#!/bin/bash
# A device call (v67; about 9 min warm): the decode with K and V by TMA on sm_90
# (`v66-decode-tma-loads.patch`: lane 0 of each warp copies a block's 16-row boxes of 64 columns on
# its ring stage's mbarrier, the values past the keys zeroed once a partial block lands; hd64 and
# hd128; the forced mma.sync family keeps cp.async). First its correctness (the KV-cache GPU tests on
# both families, with the new test of NaN/inf cache rows past the keys; memcheck and racecheck of
# the KV-cache calls), then A/B against main on the decode cells. Prediction: the single-row cells
# that trail cuDNN by 2-3% at every length (v66's H100 grid, median 0.976) gain 1-4% if the
# cp.async ring's per-lane copies and addresses held the streaming back; the short-row hd64 cells
# (128-byte rows 1-4 KB apart) the most. The step is not shorter in instructions (hd128: 430 ->
# ~440 executed; hd64 326 -> ~300), so if nothing moves the gap is the DRAM side.
# Trees: device_trees.py .device_scratch8 main=HEAD tma=HEAD+bench/notes/v66-decode-tma-loads.patch
# --kernels kvcache; carry .device_scratch8.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch8 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
T="tests/test_kvcache_gpu.py tests/test_torch_kvcache.py tests/test_launch.py tests/test_graphs.py"
gpu_tests tma kvcache_tests 150 $T
CUPYFLASH_FAMILY=mma_sync gpu_tests tma kvcache_tests_mma 90 tests/test_kvcache_gpu.py
for tool in memcheck racecheck; do
  (cd $S/tma && PYTHONPATH=. timeout 60 compute-sanitizer --tool $tool $([ $tool = racecheck ] && echo --racecheck-report hazard) \
    python tests/sanitize_run.py --kvcache-only > $OUT/$tool.log 2>&1)
  echo "$tool rc $? ($(date +%T))" >> $L; tail -2 $OUT/$tool.log >> $L
done
C=64:131072:32:8:64:dense,128:65536:32:8:64:dense,16:131072:32:32:64:dense,16:65536:32:32:128:dense
C=$C,64:65536:32:8:128:dense,128:131072:8:1:64:dense,1:131072:32:8:64:paged16,16:16384:32:8:128:paged16
C=$C,128:1024:32:8:128:dense,1:4096:32:8:64:dense,1:16384:8:1:128:dense,16:1024:8:1:64:paged256
C=$C,4:4096:32:8:64:paged16,8:131072:32:8:128:paged256
timeout 200 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/main $S/tma $S/main $S/tma 2>&1 | tail -18 >> $L
save_new_kernels
