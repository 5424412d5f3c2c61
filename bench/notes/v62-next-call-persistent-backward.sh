#!/bin/bash
# A device call (v62; about 6 min warm): the persistent wgmma backward (as many CTAs as run at once
# take the key-block tiles in rounds; the producer loads the next tile's K and V while dK and dV
# leave) against HEAD's CTA per tile, then its backward GPU tests; and v61's queued exps-on-FMA A/B.
# Prediction: +3-8% on the 1k backwards (v61's ncu: 9% of the hd64 1k causal samples wait for a
# CTA's first K and V), +0-2% from 4k on. Trees: device_trees.py .device_scratch2 main=HEAD
# pers2=HEAD+bench/notes/v62-persistent-backward.patch --kernels all; carry .device_scratch2 and .device_scratch_fma.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch2 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
timeout 200 python /tmp/ab.py --pass bwd --rounds 5 $S/main $S/pers2 $S/main 2>&1 | tail -22 >> $L
gpu_tests pers2 bwd_tests 240 tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py tests/test_torch_varlen.py
S2=$PWD/.device_scratch_fma
tar -xJf "$S2/cache.tar.xz" -C /tmp/pcache --strip-components=1
timeout 60 python /tmp/ab.py --pass fwd --rounds 5 --cells 64:1024:0,64:1024:1,64:512:1,64:1024:0:4096 \
  $S2/main $S2/fma8 $S2/fma4 $S2/main 2>&1 | tail -7 >> $L
save_new_kernels
