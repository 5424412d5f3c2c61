#!/bin/bash
# v92's last call (carry [".device_scratch_full"], built for HEAD): HEAD's ALiBi GPU tests in both
# families, the kernels all in the carried cache.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch_full source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
for family in wgmma mma_sync; do
  (CUPYFLASH_FAMILY=$family PYTHONPATH=. timeout 35 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -rf -p no:warnings \
    tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k "alibi or ALiBi" > $OUT/alibi-$family.log 2>&1)
  echo "$family rc $? ($(date +%T))" >> $L; tail -1 $OUT/alibi-$family.log >> $L; grep -E "^FAILED|^ERROR" $OUT/alibi-$family.log | head >> $L
done
cat $L
