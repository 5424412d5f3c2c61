#!/bin/bash
# A device call (v73; about 9 min): the forward's unstaged O stored as whole 128-byte lines.
# v72's quad chunks (HEAD) cut a lane's O stores four-fold (hd256 1k +15-17%), but a warp's store
# still touches 8 lines (8 rows x 64 bytes). If the store costs a cycle a line in L1, not a slot an
# instruction, pairing quad chunks across lanes ^ 16 (for_each_line_chunk: 4 more SHFL per 64
# columns) halves it: 4 rows x 128 bytes an instruction, the same instruction count.
# Prediction: if lines pace it, hd256 1k +3-6% over HEAD, hd128 16k and hd256 16k +0.5-1%; if the
# instruction count does, within noise. The causal hd128 cell (staged O, unchanged) is the control.
# Then the lines tree's forward tests (its kernels carried; HEAD's own run in the suite call).
# Trees: device_trees.py .device_scratch20 main=HEAD lines=HEAD+bench/notes/v73-fwd-o-line-chunks.patch
#   --kernels all --named bench/device-test-kernels.txt --dtypes bfloat16 float16; carry .device_scratch20.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch20 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
for dtype in bfloat16 float16; do
  cells=128:1024:0,128:4096:0,128:16384:0,256:1024:0,256:4096:0,256:16384:0,256:4096:1,128:4096:1
  [ $dtype = float16 ] && cells=128:16384:0,256:1024:0,256:16384:0
  echo "== ab fwd $dtype" >> $L
  timeout 120 python /tmp/ab.py --pass fwd --dtype $dtype --rounds 7 --cells $cells $S/main $S/lines $S/main $S/lines \
    2>&1 | tee -a $OUT/ab.txt | tail -10 >> $L
done
gpu_tests lines tests_lines 300 tests/test_gpu.py tests/test_head_dims.py tests/test_gpu_variants.py
cat $L
