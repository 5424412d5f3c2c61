#!/bin/bash
# v87's last call (little device time left): the one-key-block tests and the smoke tier, then the
# backward's kernel time with and without the store (v87-bwd-kernel-time.py). ~2.5 min cold.
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python -m pytest tests/test_smoke.py tests/test_gpu.py -q -n 15 -k "smoke or one_key_block" > $OUT/tests.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/tests.txt; grep -E "^FAILED" $OUT/tests.txt | head
PYTHONPATH=$PWD timeout 60 python bench/notes/v87-bwd-kernel-time.py > $OUT/kernel-time.txt 2>$OUT/kernel-time-err.txt
cat $OUT/kernel-time.txt; grep -v -i warn $OUT/kernel-time-err.txt | tail -3
