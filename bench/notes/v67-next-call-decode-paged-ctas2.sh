#!/bin/bash
# A device call (v67; about 2 min): long 16-row-page hd64 caches split for every resident CTA (five an
# SM: HEAD~1), at most two an SM (HEAD) or three, on the smaller batches where -paged-ctas.sh read
# three ahead of two (4 x 16k +4%, 4 x 64k +1.7%) and two ahead of three at batch 16 (+4-6%).
# Trees: device_trees.py .device_scratch9 five=HEAD~1 two=HEAD three=HEAD+PATCH --kernels kvcache.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch9 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=4:16384:32:8:64:paged16,4:65536:32:8:64:paged16,1:16384:32:8:64:paged16,4:4096:32:8:64:paged16
C=$C,8:16384:32:8:64:paged16,2:65536:32:8:64:paged16,8:131072:32:8:64:paged16,16:16384:32:8:64:paged16
C=$C,32:16384:32:8:64:paged16,1:131072:32:8:64:paged16,16:8192:32:32:64:paged16
timeout 300 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/five $S/two $S/three $S/five $S/two $S/three 2>&1 | tail -14 >> $L
