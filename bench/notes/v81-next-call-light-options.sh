#!/bin/bash
# A device call (v81, up to 8 min; carry [".device_scratch31"], or rebuild it: device_trees.py
# .device_scratch31 main=HEAD
# light=HEAD+bench/notes/v81-light-options-backward.patch --kernels ab --options '{"alibi_slopes": "random"}'
# --options '{"dropout_p": 0.1, "seed": 1}'; the forced family's kernels compile on the device).
# The light options' backward ('bwd_light': ALiBi alone, dropout alone, not deterministic): the
# mma.sync kernels run them in the plain kernels' passes on the plain tiles but where they spill
# (before: the options' fused per-element pass on their tiles); the wgmma family's tiles and code do
# not change (its 'bwd_light' is its options' table). Every other backward's SASS is unchanged.
# Prediction: mma.sync hd128 ALiBi backward 1.28-1.30x plain (v79's table) -> 1.05-1.10x, dropout
# 1.37-1.40x -> 1.15-1.25x; wgmma within noise (the same kernels).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch31 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
ab() { timeout "$1" python /tmp/ab.py --pass bwd --rounds 3 "${@:2}" 2>&1 | tee -a $OUT/ab.txt | tail -7 >> $L; }
C=64:4096:0,128:4096:0,128:4096:1,256:4096:0  # (16k dropped: device time is short)
echo "== GPU tests of light, mma.sync (forced): ALiBi, dropout, the light tables" >> $L
CUPYFLASH_FAMILY=mma_sync gpu_tests light tests-mma-sync 150 tests/test_gpu.py tests/test_gpu_variants.py \
  tests/test_head_dims.py -k "alibi or dropout or light"
echo "== mma.sync (forced): ab bwd ALiBi, dropout, main and light; then plain (main)" >> $L
CUPYFLASH_FAMILY=mma_sync ab 120 --options '{"alibi_slopes": "random"}' --cells $C $S/main $S/light
CUPYFLASH_FAMILY=mma_sync ab 120 --options '{"dropout_p": 0.1, "seed": 1}' --cells $C $S/main $S/light
CUPYFLASH_FAMILY=mma_sync ab 45 --cells $C $S/main
echo "== GPU tests of light, wgmma (its kernels unchanged; the light tables' test)" >> $L
gpu_tests light tests 60 tests/test_gpu.py tests/test_gpu_variants.py -k "light or alibi"
cat $L
