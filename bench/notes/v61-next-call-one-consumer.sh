#!/bin/bash
# A device call (v61; about 300 s warm): the wgmma forward of one consumer, two CTAs an SM
# (v61-one-consumer-two-ctas.patch: fwd_short hd64 64 x 128 on two stages; -hd128.patch adds hd128
# 64 x 64), for the calls of at most 1k rows, against the two-consumer 128-row tiles.
# Prediction: v60's ncu read cuDNN's 1k forwards (64 x 128 tiles) as 10-16% fewer cycles than ours
# with the same instructions and bytes, ours spending ~2x cuDNN's cycles a tile starting and
# ending; a second CTA on the SM hides one's start and end under the other's products: hd64 1k
# +5-10% (causal more), hd128 1k within +-5% (64-key blocks cost more a key).
# Trees: python bench/device_trees.py .device_scratch_one main=HEAD one=HEAD+bench/notes/v61-one-consumer-two-ctas.patch
#   one128=HEAD+bench/notes/v61-one-consumer-two-ctas.patch+bench/notes/v61-one-consumer-hd128.patch
# Run from the repository root, carrying .device_scratch_one.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch_one source bench/device_call.sh
L=$OUT/one_log.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L
echo "== ab fwd, main one one128 ($(date +%T))" >> $L
timeout 150 python /tmp/ab.py --pass fwd --rounds 5 --cells 64:1024:0,64:1024:1,128:1024:0,128:1024:1,64:512:1,128:512:1,64:1024:1:4096 \
  $S/main $S/one $S/one128 >> $L 2>&1
echo "== one128: test_gpu.py ($(date +%T))" >> $L
gpu_tests one128 tests_one128 240 tests/test_gpu.py
save_new_kernels
echo "done ($(date +%T))" >> $L
