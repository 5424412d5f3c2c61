#!/bin/bash
# A device call (v72; about 6 min): the forward's O stored as 16-byte rows transposed over each quad.
# Where O does not leave through a staged buffer (hd128 non-causal, every hd256 forward, hd64's
# two-consumer tile of at most 1k rows), a warp stored it as 4-byte words: 8 rows x 16 bytes a
# store instruction, every 32-byte sector written in two halves by two instructions (v71 ncu: L2
# compression input sectors 3.3M against FA4's 2.1M at hd128). Four words of a row's 32 columns,
# transposed over the quad (4 SHFL, 12 SEL), leave as one 16-byte store a lane: whole sectors.
# Prediction: O is 32 KB a tile against 0.5-8 MB of K and V read from L2, so the 16k cells move
# within noise; short cells (1k, 8 key blocks a tile) +0.5-2% (v39's staged O: +5.5% at hd128 1k
# causal); the causal hd128 cell (staged O, unchanged kernel) is the control.
# Trees: device_trees.py .device_scratch19 main=HEAD quad=HEAD+bench/notes/v72-fwd-o-quad-stores.patch
#   --kernels all --named bench/device-test-kernels.txt --dtypes bfloat16 float16; carry .device_scratch19.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch19 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
for dtype in bfloat16 float16; do
  cells=64:1024:0,128:1024:0,128:4096:0,128:16384:0,256:1024:0,256:16384:0,256:4096:1,128:4096:1
  [ $dtype = float16 ] && cells=128:1024:0,128:4096:0,256:1024:0,256:16384:0
  echo "== ab fwd $dtype" >> $L
  timeout 110 python /tmp/ab.py --pass fwd --dtype $dtype --rounds 7 --cells $cells $S/main $S/quad $S/main $S/quad \
    2>&1 | tee -a $OUT/ab.txt | tail -11 >> $L
done
gpu_tests quad tests_quad 130 tests/test_gpu.py tests/test_head_dims.py tests/test_gpu_variants.py
cat $L
