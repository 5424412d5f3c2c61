#!/bin/bash
# A device call (v64; about 9 min warm): HEAD's test_gpu.py on the default family, then the forced
# mma.sync family's test_gpu.py and test_head_dims.py. Carry .device_scratch3 (its tree main = HEAD).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch3 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests main gpu 250 tests/test_gpu.py
export CUPYFLASH_FAMILY=mma_sync
gpu_tests main mma_gpu 290 tests/test_gpu.py tests/test_head_dims.py
