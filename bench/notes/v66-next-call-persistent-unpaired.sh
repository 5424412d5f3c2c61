#!/bin/bash
# A device call (v66; about 8 min warm): pc6, the persistent backward (v63 + every grid from the
# counter) whose consumers read lse_log2 and D by 32-bit shared addresses from a base read back from
# shared memory (`v65-persistent-step-unpaired.patch`): no shared-window base recomputed in the step
# (pcount's loss, v65) and no 8-byte pairs (pc2's remaining hd128 cost, v65); the option kernels
# read the base again each step (held, 8 of them spill). Steps (`bench/sass.py steps`, here):
# hd128 80-row 545 -> 537, 64-row 484 -> 484, LOCAL 512 -> 515, hd64 738 -> 735, LOCAL 769 -> 770,
# hd256 861 -> 861, LOCAL 891 -> 891. Prediction: within 0.5% of main at hd128 4k/16k and hd64 16k,
# pcount's gains elsewhere (1k +2-4% at hd64, hd256 +1-2%). Then pc6's backward tests on the forced
# mma.sync family (the default family's in the next call).
# Trees: device_trees.py .device_scratch6 main=HEAD pc6=HEAD+bench/notes/v63-persistent-backward.patch+
# bench/notes/v65-backward-counter-everywhere.patch+bench/notes/v65-persistent-step-unpaired.patch
# --kernels all --named bench/device-test-kernels.txt; carry .device_scratch6.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch6 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
timeout 330 python /tmp/ab.py --pass bwd --rounds 11 $S/main $S/pc6 $S/main $S/pc6 2>&1 | tail -22 >> $L
export CUPYFLASH_FAMILY=mma_sync
gpu_tests pc6 bwd_tests_mma 170 tests/test_gpu.py tests/test_gpu_variants.py -k "persistent or pair_groups or varlen or deterministic"
save_new_kernels
