#!/bin/bash
# A device call (v64; about 9 min warm): v63's persistent wgmma backward against HEAD's CTA per tile
# again, 5 rounds with an A/A control (v63's 3 rounds read 16k hd64/hd128 -1.0 to -1.4%), then the
# backward's GPU tests on both families. Prediction: 1k +1-4%, 4k and 16k within +-1.5% of HEAD.
# Trees: device_trees.py .device_scratch3 main=HEAD pers3=HEAD+bench/notes/v63-persistent-backward.patch
# --kernels all; carry .device_scratch3.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch3 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
timeout 230 python /tmp/ab.py --pass bwd --rounds 5 $S/main $S/pers3 $S/main 2>&1 | tail -22 >> $L
K="backward or bwd or grad or persistent or pair_groups or deterministic or bias or dropout or varlen"
gpu_tests pers3 bwd_tests 200 tests/test_gpu.py tests/test_gpu_variants.py -k "$K"
export CUPYFLASH_FAMILY=mma_sync
gpu_tests pers3 bwd_tests_mma 110 tests/test_gpu.py tests/test_gpu_variants.py -k "persistent or pair_groups or varlen or deterministic"
save_new_kernels
