#!/bin/bash
# v87's lean call (device time was short): the one-key-block tests and smoke tier, the backward's
# kernel time with and without the store (v87-bwd-kernel-time.py), then one host A/B pair of HEAD's
# tree (.device_scratch_ab/head, carried) and this one (v86-host-ab.py). ~3 min cold.
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest tests/test_smoke.py tests/test_gpu.py -q -n 15 \
  -k "smoke or one_key_block or forward_backward" > $OUT/tests.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/tests.txt; grep -E "^FAILED" $OUT/tests.txt | head
PYTHONPATH=$PWD timeout 90 python bench/notes/v87-bwd-kernel-time.py > $OUT/kernel-time.txt 2>$OUT/kernel-time-err.txt
cat $OUT/kernel-time.txt; grep -v -i warn $OUT/kernel-time-err.txt | tail -3
PYTHONPATH=$PWD/.device_scratch_ab/head timeout 60 python bench/notes/v86-host-ab.py head >> $OUT/ab.txt 2>>$OUT/ab-err.txt
PYTHONPATH=$PWD timeout 60 python bench/notes/v86-host-ab.py patch >> $OUT/ab.txt 2>>$OUT/ab-err.txt
sort -k2,4 -s $OUT/ab.txt
