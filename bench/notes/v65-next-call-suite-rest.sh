#!/bin/bash
# A device call (v65; about 9.5 min warm, best on an H200): the GPU tests v64 did not run at HEAD,
# the framework files (the Llama training equivalence, torch.compile, the graph replays, the JAX
# and torch options, varlen, KV-cache and ring files) on the default family, then the forced
# mma.sync family's framework and KV-cache GPU files (not the bench modules' tests: the trees have
# no bench/). Carry .device_scratch4, whose tree main is HEAD (if HEAD's kernels have moved, rebuild
# it as v65-next-call-persistent-backward-variants.sh says).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch4 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
RUN_IN_V64=(test_gpu test_gpu_variants test_head_dims test_graphs test_ring_gpu test_kvcache_gpu test_torch_cuda
            test_torch_autograd test_jax_gpu test_hopper_probes test_frameworks test_smoke)
IGNORE=(); for f in "${RUN_IN_V64[@]}"; do IGNORE+=(--ignore=tests/$f.py); done
gpu_tests main rest 330 tests "${IGNORE[@]}" --ignore-glob="tests/test_bench_*"
export CUPYFLASH_FAMILY=mma_sync
gpu_tests main rest_mma 200 tests/test_kvcache_gpu.py tests/test_torch_autograd.py tests/test_torch_varlen.py \
  tests/test_torch_options.py tests/test_jax_grad.py tests/test_graphs.py
save_new_kernels
