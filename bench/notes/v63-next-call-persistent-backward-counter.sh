#!/bin/bash
# A device call (v63; about 5 min warm): the persistent wgmma backward, its LOCAL grids' tiles from a
# counter and each tile's first Q stage loaded before its K and V (v62's in static rounds lost
# 15-44% on causal grids), against HEAD's CTA per tile; then its backward GPU tests.
# Prediction: causal within +-2% of HEAD at 4k and 16k, +2-6% at 1k; non-causal 1k +1-4%.
# Trees: device_trees.py .device_scratch3 main=HEAD pers3=HEAD+bench/notes/v63-persistent-backward.patch --kernels all;
# carry .device_scratch3.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch3 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
timeout 120 python /tmp/ab.py --pass bwd --rounds 3 $S/main $S/pers3 $S/main 2>&1 | tail -22 >> $L
gpu_tests pers3 bwd_tests 170 tests/test_gpu.py tests/test_gpu_variants.py -k "persistent or pair_groups or backward or deterministic or bias or dropout or varlen"
