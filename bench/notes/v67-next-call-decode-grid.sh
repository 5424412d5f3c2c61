#!/bin/bash
# A device call (v67; about 320 s on an H100 in v66): `bench --decode`'s whole grid (816 cells)
# at HEAD: v67's hd64 decode tile and paged split rule against v66's grid (results/h100-decode.*,
# the kernels before them). No trees or kernel cache: the decode kernels compile on first use.
cd "$(dirname "$0")/../.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/log.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L
PYTHONPATH=. timeout 520 python -m cupyflash bench --decode --out $OUT/decode > $OUT/decode.log 2>&1
echo "rc $? ($(date +%T))" >> $L
tail -5 $OUT/decode.log >> $L
