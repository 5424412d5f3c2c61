#!/bin/bash
# A device call (v61; about 60 s warm): what the LOCAL forward costs beyond its masks. A window that
# covers every key (window_size (seqlen, seqlen), not causal) runs the LOCAL kernels on the plain
# calls' work, no element masked; beside the plain kernels and the causal ones at the same cells.
# Prediction: within 3% of plain at hd64 (same tile) and at hd128 (fwd_local's two stages against
# three); if LOCAL loses 8% or more, the causal cells' gap to FA4 (hd128 4k 0.84) is the LOCAL
# machinery (tile counter, slots), not the masked steps.
# Run from the repository root with .device_scratch_one carried (its cache and main tree).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch_one source bench/device_call.sh
L=$OUT/local_log.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L
for seqlen in 4096 16384; do
  CELLS=64:$seqlen:0,128:$seqlen:0,256:$seqlen:0
  echo "== plain, seqlen $seqlen ($(date +%T))" >> $L
  timeout 40 python /tmp/ab.py --pass fwd --rounds 5 --cells $CELLS $S/main >> $L 2>&1
  echo "== window ($seqlen, $seqlen) ($(date +%T))" >> $L
  timeout 40 python /tmp/ab.py --pass fwd --rounds 5 --options "{\"window_size\": [$seqlen, $seqlen]}" --cells $CELLS $S/main >> $L 2>&1
done
save_new_kernels
