#!/bin/bash
# A device call (v71; about 3 min): hd256's forwards of at most 1k query rows on 128 x 64 tiles
# (`v71-hd256-short-64-key-blocks.patch`, a 'fwd_short' entry) against HEAD's 128 x 80 ones.
# Why: a 1k causal row of 128-row tiles covers 84% useful elements in 80-key blocks, 89% in 64-key
# ones; v26 (H200) read 128 x 64 3% faster at 1k causal, 2-5% slower from 4k on (so the long calls
# keep 128 x 80). hd256 1k causal is the forward's lowest cell on the H100 (0.79-0.81 of cuDNN, v69).
# Prediction: 1k causal +3-5%, 512 causal +4-6%, 1k non-causal within 2% (1024 keys: 16 blocks of 64
# or 13 of 80, the last 80% full), bf16 and fp16 alike.
# Trees: device_trees.py .device_scratch15 main=HEAD h256=HEAD+bench/notes/v71-hd256-short-64-key-blocks.patch
#   --kernels ab --dtypes bfloat16 float16; carry .device_scratch15.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch15 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=256:1024:1,256:1024:0,256:512:1,256:512:0,256:1024:1:4096
for dtype in bfloat16 float16; do
  timeout 120 python /tmp/ab.py --pass fwd --dtype $dtype --rounds 5 --cells $C $S/main $S/h256 $S/main \
    2>&1 | tee -a $OUT/ab.txt | tail -7 >> $L
done
(cd $S/h256 && PYTHONPATH=. timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -n 8 \
  tests/test_gpu.py -k "d256" > $OUT/h256_tests.log 2>&1); echo "h256 tests rc $?" >> $L; tail -1 $OUT/h256_tests.log >> $L
cat $L
