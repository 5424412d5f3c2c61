#!/bin/bash
# A device call (v52; about 330 s warm, no trees needed): the host table (issue 18) with its first
# shape timed again at the end. Every table v42-v45 read its first shape 1.2-1.4x slow whichever it
# was, with the host kept busy beforehand; since v52 the GPU is kept busy too (benchmark._busy): if
# the two small-shape rows now agree, an idle GPU's clocks were the cause and the table judges
# issue 18's targets; if the first still reads slow, it is not the GPU either.
# Run from the repository root: bash bench/notes/v52-next-call-host.sh
cd "$(dirname "$0")/../.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/log.txt
: > $L
echo "== bench --host, small medium small ($(date +%T))" >> $L
PYTHONPATH=. timeout 420 python -m cupyflash bench --host --host-shapes small medium small --out $OUT/host >> $L 2>&1
echo "rc $? ($(date +%T))" >> $L
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,pstate --format=csv >> $L 2>&1
