#!/bin/bash
# A device call (v70; about 9.5 min): the sanitizers (memcheck and racecheck of
# tests/sanitize_run.py), `check`, then the forced mma.sync family's test_gpu.py, test_head_dims.py
# and test_gpu_variants.py. Trees and carry as v70-next-call-suite-a.sh.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch14 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
sanitizers main
(cd $S/main && PYTHONPATH=. timeout 45 python -m cupyflash check 2>&1 | tail -2) >> $L
export CUPYFLASH_FAMILY=mma_sync
gpu_tests main mma_gpu 280 tests/test_gpu.py tests/test_head_dims.py tests/test_gpu_variants.py
save_new_kernels
