#!/bin/bash
# A device call (v66; about 330 s on the H200 in v45): `bench --decode`'s whole grid (816 cells)
# at HEAD, the first since v45's (v58's split rules and v56's KV-cache dependent launches not yet
# read as a grid). No trees or kernel cache: the decode kernels compile on first use.
cd "$(dirname "$0")/../.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/log.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L
PYTHONPATH=. timeout 520 python -m cupyflash bench --decode --out $OUT/decode > $OUT/decode.log 2>&1
echo "rc $? ($(date +%T))" >> $L
tail -5 $OUT/decode.log >> $L
