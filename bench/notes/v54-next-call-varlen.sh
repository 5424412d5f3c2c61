#!/bin/bash
# A device call (v54; about 450 s warm): v53's Blackwell tables forced on the H200 (its script); the
# options table's varlen row (1.16-1.21x the plain forward, 1.11-1.15x the backward at equal lengths)
# taken apart: v53's HEAD (cu_seqlens read on the host every call), v54's (read once per tensor),
# no host read, graph replays; and the varlen 80-row backward (v54-varlen-80-row-backward.patch),
# its GPU tests and memcheck. Trees: python bench/device_trees.py .device_scratch2 main=<v53's HEAD>
# vl80=<v53's HEAD>+bench/notes/v54-varlen-80-row-backward.patch; copy this into .device_scratch2/
# and run as `bash .device_scratch2/call1.sh` (carry .device_scratch2).
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $OUT/gpu.txt
mkdir -p /tmp/pcache && tar -xJf .device_scratch2/cache.tar.xz -C /tmp/pcache --strip-components=1
S=$PWD/.device_scratch2
L=$OUT/varlen.txt
echo "== vl80: varlen GPU tests ($(date +%T))" > $L
(cd $S/vl80 && CUPYFLASH_CACHE_DIR=/tmp/pcache PYTHONPATH=. timeout 200 python -m pytest -m gpu -p no:cacheprovider -n 14 -q \
  -p no:warnings tests/ -k "varlen or packed or full_and_the_edged" > $OUT/tests_vl80.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_vl80.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_vl80.log | head -10 >> $L
for tree in main vl80; do
  echo "== varlen cost, $tree ($(date +%T))" >> $L
  CUPYFLASH_CACHE_DIR=/tmp/pcache PYTHONPATH=$S/$tree timeout 90 python bench/varlen_cost.py >> $L 2>&1
done
echo "== varlen cost, the working tree (HEAD: cu_seqlens read once) ($(date +%T))" >> $L
CUPYFLASH_CACHE_DIR=/tmp/pcache PYTHONPATH=$PWD timeout 90 python bench/varlen_cost.py --seqlens 4096 >> $L 2>&1
CUPYFLASH_CACHE_DIR=/tmp/pcache PYTHONPATH=. timeout 60 python -m pytest -m gpu -p no:cacheprovider -q -p no:warnings \
  tests/test_torch_cuda.py -k reads_a_batchs >> $L 2>&1
echo "== vl80: memcheck of a varlen backward ($(date +%T))" >> $L
(cd $S/vl80 && CUPYFLASH_CACHE_DIR=/tmp/pcache PYTHONPATH=. timeout 90 compute-sanitizer --tool memcheck python - <<'PY' 2>&1 | tail -4 >> $L
from cupyflash import _check
case = _check.Case.packed((2, 81, 1, 561, 0, 241), (2, 81, 1, 561, 0, 241), 128, "bfloat16", False, nheads=2)
print(_check.run_gpu_case(case, 5))
PY
)
echo "done ($(date +%T))" >> $L
bash bench/notes/v53-next-call-blackwell-tables.sh
