#!/bin/bash
# A device call (v56 for the next session; about 150 s warm, no trees or kernel cache needed): where
# the eager fwd+bwd's host time goes on autograd's thread (issue 18). v56 read the drop-in's backward
# 137 us dearer than the floor's empty one under autograd at 1 x 128 x 8 x 64, where the same
# backward costs 43 us called on the main thread: host_parts.py --backward's rows "floor + ...,
# there" time each part of it on autograd's thread (the call, the plan's call, the launches alone,
# the allocations, and nothing), each beside the same part on this one; and whole fwd+bwd calls
# (ours, SDPA's, the floor's) with autograd's multithreading off, the backward then on the calling
# thread (a PyTorch PR, pytorch#192004, reads the hand-off to the device thread as cache and TLB
# misses: a Python backward touches many more objects than a C++ one).
# Run from the repository root: bash bench/notes/v56-next-call-host-autograd-thread.sh
cd "$(dirname "$0")/../.."
L=$OUT/log.txt
: > $L
PYTHONPATH=. timeout 200 python bench/host_parts.py --backward 1 128 8 64 4 512 16 128 >> $L 2>&1
echo "== the backward's functions on autograd's thread, by own time (cProfile) ($(date +%T))" >> $L
PYTHONPATH=. timeout 60 python bench/host_parts.py --profile-backward 1 128 8 64 >> $L 2>&1
echo "done ($(date +%T))" >> $L
