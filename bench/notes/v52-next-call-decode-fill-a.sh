#!/bin/bash
# A device call (v52, a of two; about 250 s warm, no trees or kernel cache needed: a few decode kernels compile
# on first use): do long decode caches trail cuDNN because our CTAs leave 4 of the 132 SMs idle?
# The grid's CTA counts are powers of two (128 units on 132 SMs, 256 on 264 slots): one wave of
# 128 CTAs streams at 4.32-4.48 TB/s where cuDNN reads 4.50-4.54 (bench/notes/v52).
# Run from the repository root: bash bench/notes/v52-next-call-decode-fill-a.sh
cd "$(dirname "$0")/../.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/log.txt
: > $L
# 1. Every peer beside us at batch 128 (CTA counts of powers of two) and 132 (multiples of 132).
echo "== bench --decode, batches 128 and 132, caches 16384 and 65536 ($(date +%T))" >> $L
PYTHONPATH=. timeout 200 python -m cupyflash bench --decode --decode-batches 128 132 --decode-caches 16384 65536 \
  --out $OUT/fill > $OUT/fill.log 2>&1
echo "rc $? ($(date +%T))" >> $L
# 2. Forced split counts over caches of 67584 rows (4224 key blocks: 33 splits of 128 blocks, whole
# blocks for each of 8 warps, so 33 is exact): 128 units x 33 splits = 32 waves of 132 CTAs (hd128's
# tile, one a SM) or 16 of 264 (hd64's, two); 512 units x 33 = 64 waves of 264. Pages of 16 rows
# run the small tile (two CTAs a SM, 6 warps at hd128: 66528 rows, 4158 blocks, 33 x 126, is exact).
echo "== decode_splits, forced counts ($(date +%T))" >> $L
cd bench
PYTHONPATH=.. timeout 200 python decode_splits.py --counts 1 2 4 32 33 66 --cells \
  128:67584:8:1:128:dense 4:67584:32:32:128:dense 16:67584:32:8:128:dense 128:65536:8:1:128:dense \
  128:67584:8:1:64:dense 16:67584:32:8:64:dense 64:67584:32:8:64:dense 16:135168:32:32:64:dense \
  128:67584:32:8:64:dense 128:67584:8:1:128:paged256 \
  128:66528:8:1:128:paged16 16:66528:32:8:128:paged16 128:67584:8:1:64:paged16 >> $L 2>&1
echo "rc $? done ($(date +%T))" >> $L
