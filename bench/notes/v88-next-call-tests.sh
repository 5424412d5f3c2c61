#!/bin/bash
# The follow-up to v88-next-call-first.sh (warm, same carry): tree new's default-family GPU tests of
# the backward's callers beyond the first call's subset: test_gpu.py whole, the torch and JAX
# autograd paths whose small shapes are one key block, the head dims' file.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
gpu_tests new new-suite 330 tests/test_gpu.py tests/test_head_dims.py tests/test_torch_autograd.py \
  tests/test_torch_cuda.py tests/test_jax_gpu.py tests/test_jax_grad.py
save_new_kernels
cat $L
