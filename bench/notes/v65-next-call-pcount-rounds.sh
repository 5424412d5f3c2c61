#!/bin/bash
# A device call (v65, after v65-next-call-persistent-backward-variants.sh; about 6 min warm): pcount
# (the persistent backward, every grid's tiles from the counter) read +2.0/+3.9% at hd64 1k and
# +0.7-2.1% at hd256 beside main, and -0.2 to -1.2% in the six hd128 cells and hd64 4k/16k causal,
# where main's own two columns stood up to 2.1% apart. Those eight cells again, 11 rounds, main and
# pcount in alternate columns; then pcount's backward tests on the forced mma.sync family (the
# default family's in the next call). Trees: as the variants' call (.device_scratch4).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch4 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
CELLS=128:1024:0,128:1024:1,128:4096:0,128:4096:1,128:16384:0,128:16384:1,64:4096:1,64:16384:1
timeout 220 python /tmp/ab.py --pass bwd --rounds 11 --cells $CELLS $S/main $S/pcount $S/main $S/pcount 2>&1 | tail -12 >> $L
export CUPYFLASH_FAMILY=mma_sync
gpu_tests pcount bwd_tests_mma 170 tests/test_gpu.py tests/test_gpu_variants.py -k "persistent or pair_groups or varlen or deterministic"
save_new_kernels
