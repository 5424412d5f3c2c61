#!/bin/bash
# A device call (v70) for whichever GPU comes: on an H200, FA4's first part stashed (v51's call 1,
# so that `v51-next-call-fa4-b.sh` must follow at once) and the default suite's part 3 (the KV-cache,
# JAX, graph and head-dim files, ~4.5 min); on an H100, parts 2 and 3 (v70-next-call-suite-a.sh).
# Carry [".device_scratch14", ".device/fa4/a"].
cd "$(dirname "$0")/../.."
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"
if echo "$gpu" | grep -q H200; then
  bash bench/notes/v51-next-call-fa4-a.sh
  SCRATCH=.device_scratch14 source bench/device_call.sh
  echo "$gpu" >> $L
  (PYTHONPATH=. timeout 300 python bench/gpu_suite.py --part 3/3 -- -n 15 -q -rf -p no:cacheprovider \
    -p no:warnings > $OUT/suite3.log 2>&1); echo "suite 3/3 rc $? ($(date +%T))" >> $L
  tail -1 $OUT/suite3.log >> $L; grep -E "^FAILED|^ERROR" $OUT/suite3.log | head >> $L
  save_new_kernels
else
  bash bench/notes/v70-next-call-suite-a.sh
fi
cat $OUT/log.txt
