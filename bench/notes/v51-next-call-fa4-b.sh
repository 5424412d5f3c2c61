#!/bin/bash
# The grid beside FA4, call 2 of 2 (about 300 s: v45's bf16 and fp16 grid with the options table
# took 245-300 s): FA4 installed from the stash and .device/fa4/b, then the speed grid (fwd and bwd,
# hd 64/128/256, 1k/4k/16k, causal and not, both dtypes) and, after it, the options table.
# Run as `bash bench/notes/v51-next-call-fa4-b.sh` with carry [".device/fa4/b", ".device_scratch"], right
# after call 1; .device_scratch's kernel cache (bench/device_trees.py, `--kernels ab` of HEAD plus the
# option kernels: `--options '{"softcap": 30.0}'` ...) spares compiling on the device, where it fits
# the 64 MiB beside FA4's part.
cd "$(dirname "$0")/../.."
source .device/fa4/b/install.sh finish .device/fa4/b || exit 1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -f .device_scratch/cache.tar.xz ]; then
  mkdir -p /tmp/pcache && tar -xJf .device_scratch/cache.tar.xz -C /tmp/pcache --strip-components=1
  export CUPYFLASH_CACHE_DIR=/tmp/pcache
fi
PYTHONPATH=$PWD:$PYTHONPATH timeout -s INT 560 python -m cupyflash bench --out $OUT/grid --passes fwd bwd \
  --seqlens 1024 4096 16384 --no-memory \
  --impls cupyflash "SDPA flash (FA2)" "SDPA cuDNN" "JAX cuDNN" "FA3 (flash_attn3_jax)" "FA4 (flash-attn-4)" \
  > $OUT/grid.log 2>&1
echo "rc $?"; tail -5 $OUT/grid.log
