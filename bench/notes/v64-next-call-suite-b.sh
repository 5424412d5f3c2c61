#!/bin/bash
# A device call (v64; about 9 min warm): the rest of the default family's test_gpu.py and
# test_gpu_variants.py (not the backward parts that v64-next-call-persistent-backward.sh ran), then
# the forced mma.sync family's test_gpu.py. Carry .device_scratch3.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch3 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
K="backward or bwd or grad or persistent or pair_groups or deterministic or bias or dropout or varlen"
gpu_tests pers3 fwd_tests 250 tests/test_gpu.py tests/test_gpu_variants.py -k "not ($K)"
export CUPYFLASH_FAMILY=mma_sync
gpu_tests pers3 mma_gpu 290 tests/test_gpu.py tests/test_head_dims.py
save_new_kernels
