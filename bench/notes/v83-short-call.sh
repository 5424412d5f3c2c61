#!/bin/bash
# One short device call (about 7 min) for a session with little device time: v83's minimal call
# (the softcap A/B and its tests), then v82's forced-family tests and A/B on 3 cells.
# carry [".device_scratch33", ".device_scratch32", ".device_scratch34"].
cd "$(dirname "$0")/../.."
bash bench/notes/v83-minimal-call.sh > /dev/null 2>&1
SCRATCH=.device_scratch32 source bench/device_call.sh  # (the same $L: v82's lines follow v83's)
ab() { timeout "$1" python /tmp/ab.py --pass bwd --rounds 3 "${@:2}" 2>&1 | tee -a $OUT/ab.txt | tail -7 >> $L; }
echo "== v82 GPU tests of light, mma.sync (forced): ALiBi, dropout, the light tables, the NaN key" >> $L
CUPYFLASH_FAMILY=mma_sync gpu_tests light tests-mma-sync 130 tests/test_gpu.py tests/test_gpu_variants.py \
  tests/test_head_dims.py -k "alibi or dropout or light or nan_key"
echo "== v82 mma.sync (forced): ab bwd ALiBi, dropout, main and light" >> $L
C=64:4096:0,128:4096:0,256:4096:0
CUPYFLASH_FAMILY=mma_sync ab 60 --options '{"alibi_slopes": "random"}' --cells $C $S/main $S/light
CUPYFLASH_FAMILY=mma_sync ab 60 --options '{"dropout_p": 0.1, "seed": 1}' --cells $C $S/main $S/light
cat $L
