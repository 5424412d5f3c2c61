#!/bin/bash
# A device call (v65; about 9.5 min warm): v63's persistent backward (pers3) lost 3.5% on the H100's
# hd128 plain 4k and 16k (the 80-row kernel, static rounds; its step +5 instructions of 545) where
# it gained 1-3.5% at 1k. Two variants of its launch, the kernels unchanged: pcount takes every
# grid's tiles from the counter (the hardware's CTA-per-tile order let faster SMs take more),
# plocal keeps a CTA per tile on plain grids (the step's cost alone). Prediction: pcount within
# 1% of main on plain grids if the loss is the static turn's; plocal within 1% of main on plain
# grids if the step's instructions cost nothing measurable.
# Then pcount's backward GPU tests on both families (its kernels are pers3's and plocal's too).
# Trees: device_trees.py .device_scratch4 main=HEAD pers3=HEAD+bench/notes/v63-persistent-backward.patch
# pcount=...+bench/notes/v65-backward-counter-everywhere.patch plocal=...+bench/notes/v65-backward-persistent-local-only.patch
# (each on v63's) --kernels all --named bench/device-test-kernels.txt; carry .device_scratch4.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch4 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
timeout 260 python /tmp/ab.py --pass bwd --rounds 5 $S/main $S/pers3 $S/pcount $S/plocal $S/main 2>&1 | tail -22 >> $L
K="backward or bwd or grad or persistent or pair_groups or deterministic or bias or dropout or varlen"
gpu_tests pcount bwd_tests 180 tests/test_gpu.py tests/test_gpu_variants.py -k "$K"
export CUPYFLASH_FAMILY=mma_sync
gpu_tests pcount bwd_tests_mma 90 tests/test_gpu.py tests/test_gpu_variants.py -k "persistent or pair_groups or varlen or deterministic"
save_new_kernels
