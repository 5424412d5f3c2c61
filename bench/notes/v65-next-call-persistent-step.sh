#!/bin/bash
# A device call (v65; about 3 min warm): pc2, the persistent backward (pcount) whose consumers read
# lse_log2 and D by 32-bit shared addresses (`v65-persistent-step-shared-loads.patch`): no generic
# pointer, so no shared-window base (S2UR SR_CgaCtaId) recomputed in the step; ptxas pairs the loads
# (LDS.64) as v65's dropped pairs did. Steps: hd128 80-row 545 -> 521 (pcount 550), 64-row LOCAL
# 512 -> 504, hd64 738 -> 707, hd256 861 -> 844. Prediction: at or above main in the cells where
# pcount lost (hd128 4k/16k, hd64 16k causal) if the step's latency was the loss; -1 to -3% there
# if the pairs' hd128 cost adds to it. Trees: device_trees.py .device_scratch5 main=HEAD
# pc2=HEAD+v63+v65-backward-counter-everywhere+v65-persistent-step-shared-loads (--kernels ab).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch5 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
CELLS=128:4096:0,128:4096:1,128:16384:0,128:16384:1,64:16384:1,64:16384:0,64:4096:1,64:1024:1,128:1024:1,256:16384:0
timeout 300 python /tmp/ab.py --pass bwd --rounds 9 --cells $CELLS $S/main $S/pc2 $S/main $S/pc2 2>&1 | tail -12 >> $L
