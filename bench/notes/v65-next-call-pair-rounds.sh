#!/bin/bash
# A device call (v65; about 5 min warm): the lse_log2/D pairs (v65-bwd-lse-d-pairs.patch) read +2.6%
# at hd64 1k causal, +1.1% at hd128 4k, -1.3% at hd128 4k causal, within 0.7% elsewhere in 5 rounds
# (main's two columns up to 2.1% apart): the whole backward grid again, 11 rounds, main and pair in
# alternate columns. Trees: .device_scratch4 (as v65-next-call-persistent-backward-variants.sh).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch4 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
timeout 420 python /tmp/ab.py --pass bwd --rounds 11 $S/main $S/pair $S/main $S/pair 2>&1 | tail -22 >> $L
