#!/bin/bash
# A device call (v70; about 9 min): the default family's GPU suite, parts 2 and 3 of
# bench/gpu_suite.py, of this checkout (v69 ran part 1, 230 tests, at 2e1c5a5's code; the kernels have not changed
# since v68's FlashParams field, after which only the KV-cache files and that part ran).
# Kernels: device_trees.py .device_scratch14 main=HEAD --kernels all --named bench/device-test-kernels.txt;
# carry .device_scratch14.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch14 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
for part in 2 3; do
  (PYTHONPATH=. timeout 270 python bench/gpu_suite.py --part $part/3 -- -n 15 -q -rf -p no:cacheprovider \
    -p no:warnings > $OUT/suite$part.log 2>&1); echo "suite $part/3 rc $? ($(date +%T))" >> $L
  tail -1 $OUT/suite$part.log >> $L; grep -E "^FAILED|^ERROR" $OUT/suite$part.log | head >> $L
done
save_new_kernels
