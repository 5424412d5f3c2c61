#!/bin/bash
# v83's smallest device call (about 2.5 min; carry [".device_scratch33"]): the hd128 softcap forward,
# main against e4, over the plain one, and e4's softcap GPU tests.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch33 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
ab() { timeout "$1" python /tmp/ab.py --rounds 3 "${@:2}" 2>&1 | tee -a $OUT/ab.txt | tail -5 >> $L; }
C=128:4096:0,128:4096:1,128:16384:0
echo "== v83 ab fwd softcap 30: main, e4" >> $L
ab 60 --pass fwd --options '{"softcap": 30.0}' --cells $C $S/main $S/e4
echo "== v83 ab fwd plain: main" >> $L
ab 25 --pass fwd --cells $C $S/main
echo "== v83 GPU tests of e4: softcap" >> $L
gpu_tests e4 tests-e4 90 tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k "softcap or nan_key"
cat $L
