#!/bin/bash
# v87's first call: the one-key-block wgmma backward (dq stored by the kernel) on the GPU: its
# tests in both families, the smoke tier and test_forward_backward. ~2 min cold.
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python -m pytest tests/test_smoke.py tests/test_gpu.py -q -n 15 \
  -k "smoke or one_key_block or last_wave_split or forward_backward or pair_groups" > $OUT/tests.txt 2>&1
echo "tests rc $?"; tail -4 $OUT/tests.txt
