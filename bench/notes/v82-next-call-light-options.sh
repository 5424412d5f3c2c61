#!/bin/bash
# A device call (v82, about 5 min; carry [".device_scratch32"], or rebuild it: device_trees.py
# .device_scratch32 main=HEAD light=HEAD+bench/notes/v82-light-options-on-their-tiles.patch --kernels ab;
# the forced family's kernels compile on the device).
# v81's light backward, fixed and retabled: ALiBi's slope read per step (a CTA walks its KV group's
# heads: v81 held the first head's, and failed every GQA case with ALiBi), the light kernels on the
# options' tiles but sm90's hd128 on the plain one (v81: hd128 +20-25%, hd64 and hd256 on the plain
# tiles' spill-free stand-ins -10 to -16%).
# Prediction: hd128 as v81 (ALiBi ~1.05x plain, dropout ~1.15x); hd64 and hd256 (v82 note, by SASS)
# non-causal ALiBi within -4..0% of main, dropout 0..+9%, causal 0-10% faster (shorter LOCAL loops) than
# main (the same tiles, the plain passes); the forced family's ALiBi, dropout and light tests pass.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch32 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
ab() { timeout "$1" python /tmp/ab.py --pass bwd --rounds 3 "${@:2}" 2>&1 | tee -a $OUT/ab.txt | tail -7 >> $L; }
C=64:4096:0,64:4096:1,128:4096:0,128:4096:1,256:4096:0,256:4096:1
echo "== GPU tests of light, mma.sync (forced): ALiBi, dropout, the light tables" >> $L
CUPYFLASH_FAMILY=mma_sync gpu_tests light tests-mma-sync 150 tests/test_gpu.py tests/test_gpu_variants.py \
  tests/test_head_dims.py -k "alibi or dropout or light"
echo "== mma.sync (forced): ab bwd ALiBi, dropout, main and light" >> $L
CUPYFLASH_FAMILY=mma_sync ab 100 --options '{"alibi_slopes": "random"}' --cells $C $S/main $S/light
CUPYFLASH_FAMILY=mma_sync ab 100 --options '{"dropout_p": 0.1, "seed": 1}' --cells $C $S/main $S/light
echo "== GPU tests of light, wgmma (its kernels unchanged; the light tables' test)" >> $L
gpu_tests light tests 60 tests/test_gpu.py -k "light"
cat $L
