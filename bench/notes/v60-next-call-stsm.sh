#!/bin/bash
# A device call (v60 for a later session; about 220 s warm): v60-ds-by-stmatrix.patch, the wgmma
# backward's dS^T stored by stmatrix (a k-slice's four 8 x 8 pieces an instruction, as FA4's hd64
# backward does: 16 STSM where ours had 50 STS) instead of 4-byte stores: main loop hd64 769 -> 745
# instructions (LOCAL; 738 -> 714 plain), hd128's 64-row 512 -> 495 (484 -> 474); spill-free.
# Prediction: hd64 and hd128 64-row backwards +1-3% (the shared-memory queue's instructions, not
# bytes, fall), the 80-row control unchanged.
# Trees: python bench/device_trees.py .device_scratch main=HEAD stsm=HEAD+bench/notes/v60-ds-by-stmatrix.patch
#   --options '{"deterministic": true}'
# (or the trees of v60-next-call-zero-conv.sh with stsm added), then cp this to .device_scratch/call.sh;
# run `bash .device_scratch/call.sh`, carry .device_scratch.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
echo "== stsm: the backward tests ($(date +%T))" >> $L
gpu_tests stsm tests_stsm 110 tests/test_gpu.py -k "forward_backward or full_and_the_edged or pair_groups or no_key or deterministic"
echo "== ab bwd, main stsm ($(date +%T))" >> $L
timeout 80 python /tmp/ab.py --pass bwd --rounds 5 --cells 64:1024:1,128:1024:1,64:4096:0,128:4096:1,64:16384:1,128:1024:0 \
  $S/main $S/stsm >> $L 2>&1
echo "== ab bwd deterministic, main stsm ($(date +%T))" >> $L
timeout 30 python /tmp/ab.py --pass bwd --rounds 3 --options '{"deterministic": true}' --cells 64:1024:1,128:4096:1 $S/main $S/stsm >> $L 2>&1
save_new_kernels
echo "done ($(date +%T))" >> $L
