#!/bin/bash
# A device call (v65; about 9.5 min warm), the backward's three prepared changes in one A/B:
# - pcount, plocal: v63's persistent backward lost 3.5% on the H100's hd128 plain 4k and 16k in v64
#   (the 80-row kernel; static rounds; its step +5 instructions of 545) where it gained 1-3.5% at 1k
#   and hd256. pcount takes every grid's tiles from the counter (a CTA's 15-16 tiles in static rounds
#   sum to the slowest of 132 such sums, ~3% over the mean, v64's note); plocal keeps a CTA per tile
#   on plain grids (the step's cost alone; the kernels are pcount's). Prediction: pcount within 1%
#   of main on plain grids and v64's gains elsewhere; plocal within 1% of main on plain grids.
# - pair (`v65-bwd-lse-d-pairs.patch`): each consumer thread's lse_log2 and D of a fragment tile's
#   two query columns in one 8-byte shared load (ptxas issued two 4-byte ones): step loops hd64
#   738 -> 706, hd128 545 -> 525 (80 rows) and 484 -> 468, hd256 861 -> 845, and half the
#   shared-memory queue's entries for them (v61's ncu: mio throttle 0.72 cycles an instruction at
#   hd64 1k causal, cuDNN's 0.07). v39's pairs on that time's kernels: 0 at 64 rows, -1 to -1.7%
#   at 80. Prediction: hd64 0 to +2%, hd128 -1.5 to +0.5%, hd256 within 1%.
# Then the backward GPU tests of pcpair (pcount with pair) on both families.
# Trees: device_trees.py .device_scratch4 main=HEAD pcount=HEAD+bench/notes/v63-persistent-backward.patch+bench/notes/v65-backward-counter-everywhere.patch
# plocal=HEAD+...v63...+bench/notes/v65-backward-persistent-local-only.patch pair=HEAD+bench/notes/v65-bwd-lse-d-pairs.patch
# pcpair=(pcount's patches)+bench/notes/v65-bwd-lse-d-pairs.patch --kernels all --named bench/device-test-kernels.txt;
# carry .device_scratch4.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch4 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
timeout 260 python /tmp/ab.py --pass bwd --rounds 5 $S/main $S/pcount $S/plocal $S/pair $S/main 2>&1 | tail -22 >> $L
K="backward or bwd or grad or persistent or pair_groups or deterministic or bias or dropout or varlen"
gpu_tests pcpair bwd_tests 180 tests/test_gpu.py tests/test_gpu_variants.py -k "$K"
export CUPYFLASH_FAMILY=mma_sync
gpu_tests pcpair bwd_tests_mma 90 tests/test_gpu.py tests/test_gpu_variants.py -k "persistent or pair_groups or varlen or deterministic"
save_new_kernels
