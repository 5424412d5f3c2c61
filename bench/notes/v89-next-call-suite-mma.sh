#!/bin/bash
# The forced mma.sync family's GPU suite (every kernel family runs every GPU test), part PART of 3
# (argument 1 or 2 or 3; ~4.6 min a part), on this checkout; carry .device_scratch for its cache.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
export CUPYFLASH_FAMILY=mma_sync
for part in "$@"; do
  (PYTHONPATH=. timeout 275 python bench/gpu_suite.py --part $part/3 -- -n 15 -q -rf -p no:cacheprovider \
    -p no:warnings -o faulthandler_timeout=120 > $OUT/mma-suite$part.log 2>&1); echo "mma suite $part/3 rc $? ($(date +%T))" >> $L
  tail -1 $OUT/mma-suite$part.log >> $L; grep -E "^FAILED|^ERROR" $OUT/mma-suite$part.log | head >> $L
done
save_new_kernels
cat $L
