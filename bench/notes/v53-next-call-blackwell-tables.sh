#!/bin/bash
# A device call (v53, about 150 s warm plus v52's call a): the Blackwell tables' tiles, forced on the
# H200 (CUPYFLASH_TILES=sm100|sm120, compiled for sm_90) against the float64 reference: the forced-table
# GPU tests, and the decode at hd192, which those tables serve with hd256's tile.
# Run from the repository root: bash bench/notes/v53-next-call-blackwell-tables.sh
cd "$(dirname "$0")/../.."
L=$OUT/blackwell.txt
: > $L
echo "== forced-table GPU tests, sm100 and sm120 ($(date +%T))" >> $L
timeout 300 python -m pytest tests/test_gpu.py -q -n 14 -p no:cacheprovider \
  -k "(every_tile_table or dropout_on_every_tile_table) and (sm100 or sm120)" >> $L 2>&1
echo "rc $? ($(date +%T))" >> $L
echo "== decode at hd192 per table ($(date +%T))" >> $L
timeout 120 python - >> $L 2>&1 <<'PY'
import os
import numpy as np
import cupy as cp
from cupyflash import flash_attn_with_kvcache
rng = np.random.default_rng(53)
b, h, hk, d, cap = 3, 8, 2, 192, 700
q = rng.standard_normal((b, 1, h, d))
kc, vc = (rng.standard_normal((b, cap, hk, d)) for _ in range(2))
lens = np.array([1, 417, 700], np.int32)
ref = flash_attn_with_kvcache(q, kc.copy(), vc.copy(), cache_seqlens=lens)
from cupyflash._arrays import bfloat16_dtype
for family in ("sm90", "sm100", "sm120"):
    os.environ["CUPYFLASH_TILES"] = family
    for dtype in (np.dtype(np.float16), bfloat16_dtype()):
        rounded = [x.astype(dtype).astype(np.float64) for x in (q, kc, vc)]
        out = flash_attn_with_kvcache(*(cp.asarray(x.astype(dtype)) for x in (q, kc, vc)), cache_seqlens=cp.asarray(lens))
        out = cp.asnumpy(out).astype(np.float64)
        of_rounded = flash_attn_with_kvcache(*rounded, cache_seqlens=lens)
        print(family, dtype.name, "max error", float(np.abs(out - ref).max()), "of rounded inputs in float64",
              float(np.abs(of_rounded - ref).max()), "finite", bool(np.isfinite(out).all()))
PY
echo "rc $? ($(date +%T))" >> $L
