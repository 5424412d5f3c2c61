#!/bin/bash
# v93: the H200 grid beside FA4 (call 2 of 2, right after v51-next-call-fa4-a.sh; carry [".device/fa4/b",
# ".device_scratch_full"]): FA4 installed from the stash, then the speed grid (fwd and bwd, hd
# 64/128/256, 1k/4k/16k, causal and not; DTYPES, both by default) and the options table, then issue
# 18's host table (unless NO_HOST); GRID_SECONDS stops the grid (360 by default, so that the call stays within 600 s).
cd "$(dirname "$0")/../.."
source .device/fa4/b/install.sh finish .device/fa4/b || exit 1
SCRATCH=.device_scratch_full source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$PWD:$PYTHONPATH timeout -s INT ${GRID_SECONDS:-360} python -m cupyflash bench --out $OUT/grid --passes fwd bwd \
  --seqlens 1024 4096 16384 --dtypes ${DTYPES:-bfloat16 float16} --no-memory \
  --impls cupyflash "SDPA flash (FA2)" "SDPA cuDNN" "JAX cuDNN" "FA3 (flash_attn3_jax)" "FA4 (flash-attn-4)" \
  > $OUT/grid.log 2>&1
echo "grid rc $? ($(date +%T))"; tail -3 $OUT/grid.log
[ -n "$NO_HOST" ] && exit 0
PYTHONPATH=$PWD:$PYTHONPATH timeout 130 python -m cupyflash bench --host --out $OUT/host > $OUT/host.log 2>&1
echo "host rc $? ($(date +%T))"; grep -E "^\| [0-9]" $OUT/host/host.md
