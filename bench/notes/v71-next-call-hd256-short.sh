#!/bin/bash
# A device call (v71; about 6 min): hd256's forwards on 128 x 64 tiles where a causal row's edge
# wastes less of them, against HEAD's 128 x 80 everywhere.
#   short: a 'fwd_short' entry (`v71-hd256-short-64-key-blocks.patch`): every call of at most 1k rows;
#   local: a 'fwd_local' entry (`v71-hd256-local-64-key-blocks.patch`): every causal or window call.
# Why: a 1k causal row of 128-row tiles covers 84% useful elements in 80-key blocks, 89% in 64-key
# ones. v26 (H200, before 'fwd_short' existed): 128 x 80 was 2-4% slower at 1k causal, 2-4% faster
# at 1k non-causal and 2-5% faster at 16k (causal and not), 4k within noise. hd256 1k causal is the
# forward's lowest cell on the H100 (0.79-0.81 of cuDNN, v69), 4k causal 0.91.
# Prediction: 1k and 512 causal +3-5% in both; short: 1k non-causal -2 to -4%; local: 16k causal
# -2 to -5%, 4k causal within 2%; 4k non-causal unchanged in both (the run's control). If both
# gain at short causal calls and lose elsewhere, a table for short LOCAL calls is the candidate.
# Trees: device_trees.py .device_scratch15 main=HEAD short=HEAD+bench/notes/v71-hd256-short-64-key-blocks.patch
#   local=HEAD+bench/notes/v71-hd256-local-64-key-blocks.patch --kernels ab --dtypes bfloat16 float16;
#   carry .device_scratch15.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch15 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=256:1024:1,256:512:1,256:1024:0,256:4096:1,256:16384:1,256:4096:0
for dtype in bfloat16 float16; do
  timeout 150 python /tmp/ab.py --pass fwd --dtype $dtype --rounds 5 --cells $C $S/main $S/short $S/local $S/main \
    2>&1 | tee -a $OUT/ab.txt | tail -8 >> $L
done
(cd $S/local && PYTHONPATH=. timeout 100 python -m pytest -m gpu -q -p no:cacheprovider -n 8 \
  tests/test_gpu.py -k "d256" > $OUT/local_tests.log 2>&1); echo "local's d256 tests rc $?" >> $L; tail -1 $OUT/local_tests.log >> $L
cat $L
