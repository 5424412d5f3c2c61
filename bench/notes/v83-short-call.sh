#!/bin/bash
# One short device call (about 7 min) for a session with little device time: v83's A/B (main, e4
# only, 4 cells) and its softcap tests, then v82's forced-family tests and A/B on 3 cells.
# carry [".device_scratch33", ".device_scratch32"].
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch33 source bench/device_call.sh
tar -xJf .device_scratch32/cache.tar.xz -C /tmp/pcache --strip-components=1
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
ab() { timeout "$1" python /tmp/ab.py --rounds 3 "${@:2}" 2>&1 | tee -a $OUT/ab.txt | tail -7 >> $L; }
C=64:4096:0,128:4096:0,128:4096:1,128:16384:0
echo "== v83 ab fwd softcap 30: main, e4" >> $L
ab 70 --pass fwd --options '{"softcap": 30.0}' --cells $C $S/main $S/e4
echo "== v83 ab fwd plain: main" >> $L
ab 30 --pass fwd --cells $C $S/main
echo "== v83 GPU tests of e4: softcap" >> $L
gpu_tests e4 tests-e4 100 tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k "softcap or nan_key"
S2=$PWD/.device_scratch32
echo "== v82 GPU tests of light, mma.sync (forced): ALiBi, dropout, the light tables" >> $L
S=$S2 CUPYFLASH_FAMILY=mma_sync gpu_tests light tests-mma-sync 130 tests/test_gpu.py tests/test_gpu_variants.py \
  tests/test_head_dims.py -k "alibi or dropout or light"
echo "== v82 mma.sync (forced): ab bwd ALiBi, dropout, main and light" >> $L
C=64:4096:0,128:4096:0,256:4096:0
CUPYFLASH_FAMILY=mma_sync ab 60 --pass bwd --options '{"alibi_slopes": "random"}' --cells $C $S2/main $S2/light
CUPYFLASH_FAMILY=mma_sync ab 60 --pass bwd --options '{"dropout_p": 0.1, "seed": 1}' --cells $C $S2/main $S2/light
cat $L
