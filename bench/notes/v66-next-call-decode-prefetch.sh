#!/bin/bash
# A device call (v66; about 4 min): does an L2 prefetch size on the decode kernel's K/V copies
# (cp.async ... L2::128B / L2::256B, `v66-decode-l2-prefetch-{128,256}.patch`) lift the long
# dense cells whose rows are short and strided (hd64 with 8 or 32 kv heads: 128-byte rows 1-4 KB
# apart, 4.20-4.31 TB/s against cuDNN's 4.48-4.54 in v45's grid, where MQA's contiguous rows read
# 4.38-4.46)? Trees: device_trees.py .device_scratch7 main=HEAD pf256=HEAD+bench/notes/v66-decode-
# l2-prefetch-256.patch pf128=HEAD+bench/notes/v66-decode-l2-prefetch-128.patch; carry .device_scratch7.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch7 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=64:131072:32:8:64:dense,128:65536:32:8:64:dense,16:131072:32:32:64:dense,16:65536:32:32:128:dense
C=$C,64:65536:32:8:128:dense,128:131072:8:1:64:dense,1:131072:32:8:64:paged16,16:16384:32:8:128:paged16
C=$C,128:1024:32:8:128:dense,1:4096:32:8:64:dense
timeout 280 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/main $S/pf256 $S/pf128 $S/main 2>&1 | tail -16 >> $L
