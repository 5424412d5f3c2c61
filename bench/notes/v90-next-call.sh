#!/bin/bash
# The next session's first call (carry [".device_scratch"], built by
#   python bench/device_trees.py .device_scratch main=HEAD new=HEAD+bench/notes/v90-softcap-one-home.patch \
#     before=8c52c22
# then the softcap kernels of `new` added to its cache.tar.xz, as v90 did): 1. the softcap GPU tests
# of `new` (softcap's tanh and d/ds in one helper) in both families; 2. issue 18's host A/B, before
# (v86's tree: three launches a small fwd+bwd) against main (v90's row stores: two), three rounds
# (host_ab in bench/device_call.sh says how to read it).
cd "$(dirname "$0")/../.."
source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
for family in wgmma mma_sync; do
  export CUPYFLASH_FAMILY=$family
  gpu_tests new softcap-$family 150 -x tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k softcap
done
unset CUPYFLASH_FAMILY
host_ab 3 before main
save_new_kernels
cat $L
