#!/bin/bash
# A device call (v64; about 9.5 min warm): HEAD's sanitizers (memcheck and racecheck of
# tests/sanitize_run.py), `check`, then the default family's GPU suite but test_gpu.py (v58 ran
# that on the H100), files least recently run first. Carry .device_scratch3 (its tree main = HEAD).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch3 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
T=$S/main
echo "== memcheck ($(date +%T))" >> $L
(cd $T && PYTHONPATH=. timeout 80 compute-sanitizer --tool memcheck python tests/sanitize_run.py > $OUT/memcheck.log 2>&1; echo "rc $?"; tail -2 $OUT/memcheck.log) >> $L
echo "== racecheck ($(date +%T))" >> $L
(cd $T && PYTHONPATH=. timeout 120 compute-sanitizer --tool racecheck --racecheck-report hazard python tests/sanitize_run.py > $OUT/racecheck.log 2>&1; echo "rc $?"; tail -2 $OUT/racecheck.log) >> $L
(cd $T && PYTHONPATH=. timeout 45 python -m cupyflash check 2>&1 | tail -2) >> $L
gpu_tests main suite 290 tests/test_gpu_variants.py tests/test_head_dims.py tests/test_graphs.py tests/test_ring_gpu.py \
  tests/test_kvcache_gpu.py tests/test_torch_cuda.py tests/test_torch_autograd.py tests/test_jax_gpu.py tests/test_hopper_probes.py \
  tests/test_frameworks.py tests/test_smoke.py
