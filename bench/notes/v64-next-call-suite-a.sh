#!/bin/bash
# A device call (v64; about 9 min warm): the default family's GPU suite on the persistent backward's
# tree, all but the parts of test_gpu.py and test_gpu_variants.py that v64-next-call-persistent-backward.sh
# ran; memcheck and racecheck of tests/sanitize_run.py; `check`. Carry .device_scratch3.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch3 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
T=$S/pers3
for tool in memcheck racecheck; do
  echo "== $tool ($(date +%T))" >> $L
  extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
  (cd $T && PYTHONPATH=. timeout 80 compute-sanitizer --tool $tool "${extra[@]}" python tests/sanitize_run.py 2>&1 | tail -3) >> $L
done
(cd $T && PYTHONPATH=. timeout 60 python -m cupyflash check 2>&1 | tail -3) >> $L
gpu_tests pers3 suite_rest 330 tests --ignore=tests/test_gpu.py --ignore=tests/test_gpu_variants.py
save_new_kernels
