#!/bin/bash
# A device call (v67; about 3 min): long paged caches split for at most two CTAs per SM (HEAD) against
# three (PAGED_CTAS_PER_SM = 3), after -ring-ab.sh read two +1.8-4.5% on 16-row pages of 16k-128k
# rows but 4 x 64k -1.2% (8 splits where 4 x 2's sweep read 10 best).
# Trees: device_trees.py .device_scratch9 two=HEAD three=HEAD+PATCH (the one-line change) --kernels kvcache.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch9 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=1:131072:32:8:64:paged16,4:65536:32:8:64:paged16,16:131072:32:8:64:paged16,16:16384:32:8:64:paged16
C=$C,4:131072:32:8:64:paged16,1:16384:32:8:64:paged16,4:16384:32:8:64:paged16,64:16384:32:8:64:paged16
C=$C,4:4096:32:8:64:paged16,16:4096:32:8:64:paged16,1:131072:32:8:128:paged16
timeout 300 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/two $S/three $S/two $S/three 2>&1 | tail -14 >> $L
