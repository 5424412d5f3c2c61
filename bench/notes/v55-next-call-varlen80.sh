#!/bin/bash
# A device call (v55; about 350 s warm): the 80-row varlen backward (v54-varlen-80-row-backward.patch as
# fixed in v55: the parameter block's padded head stride now follows the tile's wider varlen gaps): its
# varlen GPU tests, the three packings that failed in v55, memcheck of one, and the varlen row's cost
# beside HEAD (bench/notes/v55); then a fwd+bwd's host time by its parts (issue 18: host_parts.py --backward).
# Trees: python bench/device_trees.py .device_scratch main=HEAD vl80=HEAD+bench/notes/v54-varlen-80-row-backward.patch
# Copy into .device_scratch/ and run as `bash .device_scratch/varlen80.sh` (carry .device_scratch).
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
cat > /tmp/packings.py <<'PY'
from cupyflash import _check
for lens in ((2, 81, 1, 561, 0, 241), (81, 81, 81), (200, 100)):
    result = _check.run_gpu_case(_check.Case.packed(lens, lens, 128, "bfloat16", False, nheads=2), 5)
    print(lens, [(c.name, round(c.error, 4), round(c.bound, 4)) for c in result.checks])
PY
echo "== vl80: varlen GPU tests ($(date +%T))" >> $L
(cd $S/vl80 && PYTHONPATH=. timeout 200 python -m pytest -m gpu -p no:cacheprovider -n 14 -q -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py -k "varlen or packed or full_and_the_edged" > $OUT/tests_vl80.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_vl80.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_vl80.log | head -10 >> $L
echo "== vl80: v55's failing packings, then memcheck ($(date +%T))" >> $L
(cd $S/vl80 && PYTHONPATH=. timeout 60 python /tmp/packings.py >> $L 2>&1)
(cd $S/vl80 && PYTHONPATH=. timeout 90 compute-sanitizer --tool memcheck python /tmp/packings.py 2>&1 | tail -2 >> $L)
for tree in main vl80; do
  echo "== varlen cost, $tree ($(date +%T))" >> $L
  PYTHONPATH=$S/$tree timeout 60 python bench/varlen_cost.py >> $L 2>&1
done
echo "== host_parts --backward, HEAD ($(date +%T))" >> $L
PYTHONPATH=. timeout 150 python bench/host_parts.py --backward 1 128 8 64 4 512 16 128 >> $L 2>&1
save_new_kernels
echo "done ($(date +%T))" >> $L
