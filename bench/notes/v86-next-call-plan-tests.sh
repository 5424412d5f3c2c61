#!/bin/bash
# v86's third call: the GPU tests of the paths v86's Plan.call change touches beyond torch's (CuPy's
# kept scratch, XLA's workspaces, graph captures, the decode's plans), then `check`. ~7 min cold.
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest tests/test_graphs.py tests/test_jax_gpu.py tests/test_jax_graphs.py tests/test_jax_varlen.py \
  tests/test_jax_kvcache.py tests/test_jax_ffi.py tests/test_kvcache_gpu.py -q -n 15 > $OUT/tests-a.txt 2>&1
echo "tests a rc $?"; tail -3 $OUT/tests-a.txt
timeout 260 python -m pytest tests/test_gpu.py -q -n 15 > $OUT/tests-b.txt 2>&1
echo "tests b rc $?"; tail -3 $OUT/tests-b.txt
timeout 60 python -m cupyflash check > $OUT/check.txt 2>&1
echo "check rc $?"; tail -3 $OUT/check.txt
