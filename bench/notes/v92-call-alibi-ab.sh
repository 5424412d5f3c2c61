#!/bin/bash
# v92's second call (carry [".device_scratch"], as v91-next-call.sh): the ALiBi forward A/B again,
# main / new / main (the repeat shows the noise: v91's call read hd256, unchanged by the patch,
# 8% apart), more rounds, each round printed; causal cells first under suspicion (new 3-5% slower
# there, 1-3% faster without causal). Then main's plain forward for the option's ratio.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
CELLS=128:4096:0,128:16384:0,128:4096:1,128:16384:1,64:4096:0,64:16384:1,256:4096:0
ab 100 --rounds 5 --cells $CELLS --options '{"alibi_slopes": "random"}' $S/main $S/new $S/main
ab 30 --rounds 2 --cells $CELLS $S/main
save_new_kernels
cat $L
