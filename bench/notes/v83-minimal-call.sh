#!/bin/bash
# v83's smallest device call (about 3 min; carry [".device_scratch33"], and
# .device_scratch34 for p1 and p2): the softcap forward of main,
# e2, e4 and e6 over the plain one (ab's cells cost seconds, the tests' kernels minutes), and e4's
# softcap GPU tests.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch33 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
ab() { timeout "$1" python /tmp/ab.py --rounds 3 "${@:2}" 2>&1 | tee -a $OUT/ab.txt | tail -8 >> $L; }
C=64:4096:0,64:4096:1,128:4096:0,128:4096:1,128:16384:0,256:4096:0
echo "== v83 ab fwd softcap 30: main, e2, e4, e6" >> $L
ab 75 --pass fwd --options '{"softcap": 30.0}' --cells $C $S/main $S/e2 $S/e4 $S/e6
echo "== v83 ab fwd plain: main" >> $L
ab 25 --pass fwd --cells $C $S/main
if [ -d .device_scratch34 ]; then  # (carried too: hd64's plain forward with 1 or 2 eighths moved)
  tar -xJf .device_scratch34/cache.tar.xz -C /tmp/pcache --strip-components=1
  echo "== v83 ab fwd plain hd64: main, p1, p2" >> $L
  ab 40 --pass fwd --cells 64:1024:0,64:4096:0,64:4096:1,64:16384:0 $S/main $PWD/.device_scratch34/p1 $PWD/.device_scratch34/p2
fi
echo "== v83 GPU tests of e4: softcap" >> $L
gpu_tests e4 tests-e4 90 tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k "softcap or nan_key"
cat $L
