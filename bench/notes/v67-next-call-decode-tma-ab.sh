#!/bin/bash
# A device call (v67, after v67-next-call-decode-tma.sh if its tests passed; about 5 min): the TMA
# decode against main on 14 decode cells, 5 rounds, the trees alternated twice (prediction in that
# script's header). Trees and carry as there (.device_scratch8).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch8 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=64:131072:32:8:64:dense,128:65536:32:8:64:dense,16:131072:32:32:64:dense,16:65536:32:32:128:dense
C=$C,64:65536:32:8:128:dense,128:131072:8:1:64:dense,1:131072:32:8:64:paged16,16:16384:32:8:128:paged16
C=$C,128:1024:32:8:128:dense,1:4096:32:8:64:dense,1:16384:8:1:128:dense,16:1024:8:1:64:paged256
C=$C,4:4096:32:8:64:paged16,8:131072:32:8:128:paged256
timeout 420 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/main $S/tma $S/main $S/tma 2>&1 | tail -18 >> $L
save_new_kernels
