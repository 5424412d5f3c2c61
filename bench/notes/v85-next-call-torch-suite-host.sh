#!/bin/bash
# v85's second call: every torch GPU test file (the ops now defined through torch.library.Library,
# their CUDA calls on the resolved plans), then the host table at the issue's two shapes.
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 300 python -m pytest tests/test_torch_*.py tests/test_graphs.py tests/test_frameworks.py -q \
  -k "not ring" > $OUT/tests.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests.txt; grep -E "FAILED|Error" $OUT/tests.txt | head
timeout 270 python -m cupyflash bench --host --host-shapes small medium --out $OUT/host > $OUT/host.log 2>&1
echo "host rc $?"; tail -3 $OUT/host.log
grep "^| 1x128\|^| 4x512" $OUT/host/host.md
