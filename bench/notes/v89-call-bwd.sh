#!/bin/bash
# v89's fourth call: tree new's tests that reach the backward (the forward-only tests of test_gpu.py
# are CPU-reference bound and took the earlier calls' time).
cd "$(dirname "$0")/../.."
source bench/device_call.sh
gpu_tests new new-bwd 200 tests/test_head_dims.py tests/test_torch_autograd.py tests/test_torch_cuda.py \
  tests/test_jax_grad.py tests/test_gpu.py -k "backward or grad or one_key_block"
cat $L
