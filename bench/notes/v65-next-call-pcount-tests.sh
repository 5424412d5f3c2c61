#!/bin/bash
# A device call (v65, right after v65-next-call-pcount-rounds.sh; about 5.5 min warm): pcount's
# backward GPU tests on the default (wgmma) family, the selection of the variants' call.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch4 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
K="backward or bwd or grad or persistent or pair_groups or deterministic or bias or dropout or varlen"
gpu_tests pcount bwd_tests 320 tests/test_gpu.py tests/test_gpu_variants.py -k "$K"
save_new_kernels
