#!/bin/bash
# A device call (v61; about 20 s warm): hd64's short (two-consumer, 128-row) forward with every 8th
# or 4th column tile's exps on the FMA pipe (v61-fwd-hd64-short-exps-on-fma.patch, -every-4.patch:
# v44's polynomial, now only in the two-consumer kernel of calls of at most 1k rows).
# Prediction: v61's stall reasons put our 1k forward's extra stall at the exps (the special-function
# unit's rate); v44 measured this on the three-consumer 4k/16k kernel, whose softmax hides under
# two other consumers' products (-11%). Here each softmax outlasts the one other consumer's products:
# main step 433 -> 506 (every 8th) / 578 (every 4th) instructions, MUFU 66 -> 58 / 50: +0-5% at 1k
# if the unit sets the pace, -5 to -10% if the instructions do.
# Trees: python bench/device_trees.py .device_scratch_fma main=HEAD fma8=HEAD+bench/notes/v61-fwd-hd64-short-exps-on-fma.patch
#   fma4=HEAD+bench/notes/v61-fwd-hd64-short-exps-on-fma-every-4.patch; carry .device_scratch_fma.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch_fma source bench/device_call.sh
timeout 60 python /tmp/ab.py --pass fwd --rounds 5 --cells 64:1024:0,64:1024:1,64:512:1,64:1024:0:4096 \
  $S/main $S/fma8 $S/fma4 $S/main 2>&1 | tail -7
