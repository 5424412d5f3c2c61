#!/bin/bash
# The second call (about 9 min; carry [".device_scratch21"]): the exps tree's forward GPU tests (both
# families' kernels; 439 tests, ~300 s on an H100) and its sanitizers.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch21 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests exps tests_exps 340 tests/test_gpu.py tests/test_head_dims.py tests/test_gpu_variants.py
sanitizers exps
cat $L
