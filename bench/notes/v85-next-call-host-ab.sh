#!/bin/bash
# v85's call: the torch GPU tests on the patched tree, then the host A/B (v85-host-ab.py) of HEAD's
# tree (.device_scratch_ab/head, carried) and the patched one in turns, HEAD first. ~6 minutes.
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest tests/test_torch_ops.py tests/test_torch_compile.py tests/test_torch_cuda.py \
  tests/test_torch_kvcache.py tests/test_graphs.py tests/test_torch_autograd.py -q -x > $OUT/tests.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests.txt
for round in 1 2; do
  PYTHONPATH=$PWD/.device_scratch_ab/head timeout 150 python bench/notes/v85-host-ab.py head >> $OUT/ab.txt 2>>$OUT/ab-err.txt
  PYTHONPATH=$PWD timeout 150 python bench/notes/v85-host-ab.py patch >> $OUT/ab.txt 2>>$OUT/ab-err.txt
done
sort -k2,4 $OUT/ab.txt | head -80
