#!/bin/bash
# A device call (v56, third; about 400 s warm): a fwd+bwd's host time by its parts with the two new
# rows (the floor's Function with our forward, then with our backward, on autograd's thread), then
# HEAD's default-family test_gpu.py, test_gpu_variants.py and test_head_dims.py (426 tests; HEAD
# landed the 80-row varlen backward, the KV-cache dependent launches and the backward's pair groups).
# Trees: python bench/device_trees.py .device_scratch --kernels all head=HEAD
# Copy into .device_scratch/ and run as `bash .device_scratch/suite.sh` (carry .device_scratch).
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
echo "== host_parts --backward ($(date +%T))" >> $L
(cd $S/head && cp $OLDPWD/bench/host_parts.py /tmp/ && PYTHONPATH=. timeout 90 python /tmp/host_parts.py --backward 1 128 8 64 4 512 16 128 >> $L 2>&1)
echo "== head: default family, three files ($(date +%T))" >> $L
(cd $S/head && PYTHONPATH=. timeout 320 python -m pytest -m gpu -p no:cacheprovider -n 15 -v -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py > $OUT/tests_head.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_head.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_head.log | head -20 >> $L
grep -c PASSED $OUT/tests_head.log >> $L
save_new_kernels
echo "done ($(date +%T))" >> $L
