#!/bin/bash
# After v89-next-call-first.sh (warm, same carry; ~9.5 min): the default family's GPU suite of this
# checkout, parts 1 and 2 of bench/gpu_suite.py's 3 (land or drop v89's 16-byte patch first, so that
# the suite runs the code that stays). The kernels are in .device_scratch's cache where the
# checkout is HEAD at its build; the rest compile here.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
for part in 1 2; do
  (PYTHONPATH=. timeout 275 python bench/gpu_suite.py --part $part/3 -- -n 15 -q -rf -p no:cacheprovider \
    -p no:warnings -o faulthandler_timeout=120 > $OUT/suite$part.log 2>&1); echo "suite $part/3 rc $? ($(date +%T))" >> $L
  tail -1 $OUT/suite$part.log >> $L; grep -E "^FAILED|^ERROR" $OUT/suite$part.log | head >> $L
done
save_new_kernels
cat $L
