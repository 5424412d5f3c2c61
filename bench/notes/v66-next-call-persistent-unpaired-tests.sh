#!/bin/bash
# A device call (v66, after v66-next-call-persistent-unpaired.sh if pc6 lost no cell; about 9 min
# warm): pc6's backward GPU tests on the default family (v65's selection; ~370 tests, 180 s ran 68%
# of them in v65), then its memcheck and racecheck on the sanitizer cases. Trees: .device_scratch6.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch6 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
K="backward or bwd or grad or persistent or pair_groups or deterministic or bias or dropout or varlen"
gpu_tests pc6 bwd_tests 330 tests/test_gpu.py tests/test_gpu_variants.py -k "$K"
sanitizers pc6
save_new_kernels
