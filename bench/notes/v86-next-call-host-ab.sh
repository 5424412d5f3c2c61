#!/bin/bash
# v86's call: the torch and graph GPU tests on the patched tree, then the host A/B (v86-host-ab.py)
# of HEAD's tree (.device_scratch_ab/head, carried) and the patched one in turns, HEAD first. ~5 min.
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 220 python -m pytest tests/test_graphs.py tests/test_launch.py tests/test_torch_ops.py tests/test_torch_cuda.py \
  tests/test_torch_autograd.py tests/test_torch_dropin.py tests/test_torch_kvcache.py -q -x -n 8 > $OUT/tests.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests.txt
for round in 1 2; do
  PYTHONPATH=$PWD/.device_scratch_ab/head timeout 100 python bench/notes/v86-host-ab.py head >> $OUT/ab.txt 2>>$OUT/ab-err.txt
  PYTHONPATH=$PWD timeout 100 python bench/notes/v86-host-ab.py patch >> $OUT/ab.txt 2>>$OUT/ab-err.txt
done
sort -k2,4 $OUT/ab.txt
tail -5 $OUT/ab-err.txt
