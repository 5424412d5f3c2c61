#!/bin/bash
# A device call (v67, after -hd64-ring.sh; about 2 min): the ring sweep's follow-up. That sweep read
# hd64's 8-warp tile on 4 stages (one CTA an SM) 0-3% faster than 3 stages (two) on long dense
# caches and +3% on 16-row pages, and 3.09 against 2.70 TB/s on 16 x 16k at one split. Here main's
# 16-row-page tiles (hd64 4 x 2, hd128 6 x 2) beside the candidates on long caches, both head dims,
# to choose the long small-page table and hd64's dense ring. HEAD's tree (.device_scratch8/main).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch8 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
cd $S/main
PYTHONPATH=. timeout 250 python $OLDPWD/bench/decode_tiles.py --tiles=16:4:2,16:8:3,16:8:4 \
  1:131072:32:8:64 16:131072:32:8:64 4:65536:32:8:64 16:16384:32:8:64 64:131072:32:8:64 128:8192:32:8:64 >> $L 2>&1
PYTHONPATH=. timeout 250 python $OLDPWD/bench/decode_tiles.py --tiles=16:6:2,16:8:3,16:6:4 \
  1:131072:32:8:128 16:131072:32:8:128 4:65536:32:8:128 16:16384:32:8:128 64:16384:32:8:128 >> $L 2>&1
echo "rc $? ($(date +%T))" >> $L
