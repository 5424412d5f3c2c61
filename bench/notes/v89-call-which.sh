#!/bin/bash
# v89's third call: the same files as v89-call-tests.sh on tree new, verbose, with faulthandler
# dumping any test past 60 s, to name the tests still running when the time runs out.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
gpu_tests new new-verbose 260 -v -o faulthandler_timeout=60 tests/test_gpu.py tests/test_head_dims.py \
  tests/test_torch_autograd.py tests/test_torch_cuda.py tests/test_jax_gpu.py tests/test_jax_grad.py
grep -c PASSED $OUT/new-verbose.log >> $L
cat $L
