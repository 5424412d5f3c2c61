#!/bin/bash
# v89's second call (warm, carry .device_scratch with calls 1-2's kernels in its cache): tree new's
# default-family GPU tests of the backward's callers again (call 2 ran out of time at 424 passed while
# compiling), then the sanitizers on new.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
gpu_tests new new-suite 300 tests/test_gpu.py tests/test_head_dims.py tests/test_torch_autograd.py \
  tests/test_torch_cuda.py tests/test_jax_gpu.py tests/test_jax_grad.py
sanitizers new
save_new_kernels
cat $L
