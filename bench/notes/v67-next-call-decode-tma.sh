#!/bin/bash
# A device call (v67; about 6 min warm): the decode with K and V by TMA on sm_90
# (`v66-decode-tma-loads.patch`: lane 0 of each warp copies a block's 16-row boxes of 64 columns on
# its ring stage's mbarrier, the values past the keys zeroed once a partial block lands; hd64 and
# hd128; the forced mma.sync family keeps cp.async). First its correctness (the KV-cache GPU tests on
# both families, with the new test of NaN/inf cache rows past the keys; memcheck and racecheck of
# the KV-cache calls); the A/B against main is the next call (`-ab.sh`). Prediction: the single-row cells
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
sanitizers tma --kvcache-only
save_new_kernels
