#!/bin/bash
# v93's first call (fresh, carry [".device_scratch_full"], built for HEAD): HEAD's ALiBi GPU tests in
# both families (v92's restricted products never ran), then issue 18's eager host A/B of HEAD alone,
# three processes in turns (read only where SDPA's own columns look quiet).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch_full source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
for family in wgmma mma_sync; do
  (CUPYFLASH_FAMILY=$family PYTHONPATH=. timeout 60 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -rf -p no:warnings \
    tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k "alibi or ALiBi" > $OUT/alibi-$family.log 2>&1)
  echo "$family rc $? ($(date +%T))" >> $L; tail -1 $OUT/alibi-$family.log >> $L; grep -E "^FAILED|^ERROR" $OUT/alibi-$family.log | head >> $L
done
host_ab 3 head
sort -k2,4 $OUT/host-ab.txt >> $L
tail -3 $OUT/host-ab-err.txt >> $L
save_new_kernels
cat $L
