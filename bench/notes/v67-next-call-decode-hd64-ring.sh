#!/bin/bash
# A device call (v67; about 6 min, after v67-next-call-decode-tma.sh): are the hd64 decode's long
# cells short of bytes in flight? v66's H100 grid: hd64 single-row decode 0.965 of cuDNN (hd128
# 0.982), lowest on the long caches whose 128-byte rows are 1-4 KB apart (64 x 128k 32/8 0.94).
# hd64's dense tile (16 keys, 8 warps, 3 stages) keeps 2 blocks of 4 KB (K and V) a warp in flight;
# deeper rings (4, 5 stages) and 32-key steps double it. bench/decode_tiles.py forces each tile on
# both decode tables, dense and 16-row pages, at the split count the rules pick (*) and around it,
# beside cuDNN. Run on HEAD's tree (.device_scratch8/main; the kernels compile on first use).
# First bench/decode_stream.py (~40 s): the same bytes streamed with no attention, one head's rows a
# CTA (the decode's pattern) against every head's whole rows a CTA, at the decode's two CTAs an SM
# and at full occupancy: if per_head reads below all_heads, the strided rows cost DRAM bandwidth and
# the fix is CTAs over heads; if both read alike at full occupancy but not at two CTAs an SM, the
# decode is short of loads in flight and deeper rings (the sweep below) are the fix.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch8 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
timeout 90 python bench/decode_stream.py >> $L 2>&1
(cd $S/main && PYTHONPATH=. timeout 330 python $OLDPWD/bench/decode_tiles.py --tiles=16:8:3,16:8:4,16:8:5,32:8:3,32:8:4 \
  64:131072:32:8:64 128:65536:32:8:64 16:131072:32:32:64 1:131072:32:8:64 16:16384:32:8:64) >> $L 2>&1
echo "rc $? ($(date +%T))" >> $L
