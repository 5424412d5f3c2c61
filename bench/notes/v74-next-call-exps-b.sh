#!/bin/bash
# The second call (about 9 min; carry [".device_scratch21"]): the GPU tests of the tree with both
# v74 kernel patches (the forward's exps before its P V wait, the backward's dK into the next step;
# 439 tests of both passes, ~300 s on an H100), then its sanitizers.
# Trees (call a's): device_trees.py .device_scratch21 main=HEAD exps=HEAD+bench/notes/v74-fwd-exps-before-the-pv-wait.patch
#   dk=HEAD+bench/notes/v74-bwd-dk-runs-into-the-next-step.patch
#   both=HEAD+bench/notes/v74-fwd-exps-before-the-pv-wait.patch+bench/notes/v74-bwd-dk-runs-into-the-next-step.patch
#   --kernels all --named bench/device-test-kernels.txt --dtypes bfloat16 float16 (16 MB).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch21 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests both tests_both 340 tests/test_gpu.py tests/test_head_dims.py tests/test_gpu_variants.py
sanitizers both
cat $L
