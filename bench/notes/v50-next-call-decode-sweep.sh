#!/bin/bash
# Next call (v50; about 40 s of GPU time): the small decode tile's two consistent regions of v50's
# sweep, repeated at finer steps (7 rounds), to decide a rule for _kvcache._table. Trees in
# .device_scratch: main = HEAD, small = HEAD + v46-decode-small-tile-for-clusters.experiment.patch
# (python bench/device_trees.py .device_scratch main=HEAD small=HEAD+bench/notes/v46-decode-small-tile-for-clusters.experiment.patch --kernels all).
# Copy into .device_scratch/ and run as `bash .device_scratch/next_call_sweep.sh` (carry .device_scratch).
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
C=12:1024:8:1:64:dense,16:1024:8:1:64:dense,20:1024:8:1:64:dense,24:1024:8:1:64:dense,28:1024:8:1:64:dense,32:1024:8:1:64:dense,40:1024:8:1:64:dense,48:1024:8:1:64:dense,56:1024:8:1:64:dense,12:2048:8:1:64:dense,16:2048:8:1:64:dense,20:2048:8:1:64:dense,24:2048:8:1:64:dense,28:2048:8:1:64:dense,32:2048:8:1:64:dense,40:2048:8:1:64:dense,48:2048:8:1:64:dense,56:2048:8:1:64:dense,12:3072:8:1:64:dense,16:3072:8:1:64:dense,20:3072:8:1:64:dense,24:3072:8:1:64:dense,28:3072:8:1:64:dense,32:3072:8:1:64:dense,40:3072:8:1:64:dense,48:3072:8:1:64:dense,56:3072:8:1:64:dense,5:1024:32:8:64:dense,6:1024:32:8:64:dense,8:1024:32:8:64:dense,16:1024:8:1:64:paged16,24:1024:8:1:64:paged16,32:1024:8:1:64:paged16,40:1024:8:1:64:paged16,48:1024:8:1:64:paged16,9:1024:8:1:128:dense,12:1024:8:1:128:dense,16:1024:8:1:128:dense,20:1024:8:1:128:dense,24:1024:8:1:128:dense,9:1536:8:1:128:dense,12:1536:8:1:128:dense,16:1536:8:1:128:dense,20:1536:8:1:128:dense,24:1536:8:1:128:dense,9:2048:8:1:128:dense,12:2048:8:1:128:dense,16:2048:8:1:128:dense,20:2048:8:1:128:dense,24:2048:8:1:128:dense,9:1024:8:1:128:paged16,12:1024:8:1:128:paged16,16:1024:8:1:128:paged16,20:1024:8:1:128:paged16,24:1024:8:1:128:paged16
echo "== ab decode main small ($(date +%T))" >> $L
timeout 120 python /tmp/ab.py --pass decode --rounds 7 --cells $C $S/main $S/small >> $L 2>&1
echo "rc $? done ($(date +%T))" >> $L
