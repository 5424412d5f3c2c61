#!/bin/bash
# A device call (v71; about 5 min): hd256's short and LOCAL forwards on 128 x 64 tiles
# (`v71-hd256-64-key-blocks.patch`: 'fwd_short' and 'fwd_local' entries) against HEAD's 128 x 80.
# Why: a 1k causal row of 128-row tiles covers 84% useful elements in 80-key blocks, 89% in 64-key
# ones; v26 (H200) read 128 x 64 3% faster at 1k causal and 2-5% slower from 4k on, measured on the
# plain calls; causal rows past 1k were not timed apart. hd256 1k causal is the forward's lowest
# cell on the H100 (0.79-0.81 of cuDNN, v69), 4k causal 0.91.
# Prediction: 1k and 512 causal +3-6%; 1k non-causal within 2% (1024 keys: 16 blocks of 64 or 13 of
# 80, the last 80% full); 4k causal within 2%, 16k causal -1 to -3% (v26's long-call loss, halved by
# the skipped blocks); 4k non-causal unchanged (the plain table keeps 128 x 80): the run's control.
# If the LOCAL rows lose, land the 'fwd_short' entry alone.
# Trees: device_trees.py .device_scratch15 main=HEAD h256=HEAD+bench/notes/v71-hd256-64-key-blocks.patch
#   --kernels ab --dtypes bfloat16 float16; carry .device_scratch15.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch15 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=256:1024:1,256:512:1,256:1024:0,256:4096:1,256:16384:1,256:4096:0
for dtype in bfloat16 float16; do
  timeout 140 python /tmp/ab.py --pass fwd --dtype $dtype --rounds 5 --cells $C $S/main $S/h256 $S/main \
    2>&1 | tee -a $OUT/ab.txt | tail -8 >> $L
done
(cd $S/h256 && PYTHONPATH=. timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -n 8 \
  tests/test_gpu.py -k "d256" > $OUT/h256_tests.log 2>&1); echo "h256 tests rc $?" >> $L; tail -1 $OUT/h256_tests.log >> $L
cat $L
