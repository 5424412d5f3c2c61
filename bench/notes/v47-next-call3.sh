#!/bin/bash
# Next call 3 (prepared in v47, kept through v48: sessions without a device): the forced mma.sync family's GPU files that v46 did not reach, and
# its memcheck, on main (HEAD); v48 added the variants' packings without query or key rows. About 300 s.
cd "$(dirname "$0")/.."
source bench/device_call.sh
echo "== main, forced mma_sync: the GPU files v46 did not reach ($(date +%T))" > $L
cd $S/main
CUPYFLASH_FAMILY=mma_sync PYTHONPATH=. timeout 200 python -m pytest -m gpu -n 12 -v -p no:cacheprovider -p no:warnings \
  $(ls tests/test_*.py | grep -v -e test_gpu.py -e test_head_dims.py -e test_gpu_variants.py -e test_bench_context_parallel.py) \
  > $OUT/forced_rest.log 2>&1
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/forced_rest.log >> $L; grep -E "FAILED|ERROR" $OUT/forced_rest.log | head -20 >> $L
echo "== main, forced mma_sync: v48's varlen cases without query or key rows ($(date +%T))" >> $L
CUPYFLASH_FAMILY=mma_sync PYTHONPATH=. timeout 60 python -m pytest -m gpu -n 12 -v -p no:cacheprovider -p no:warnings \
  tests/test_gpu_variants.py -k "sq0 or sk0" > $OUT/forced_empty.log 2>&1
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/forced_empty.log >> $L; grep -E "FAILED|ERROR" $OUT/forced_empty.log | head -20 >> $L
echo "== main, forced mma_sync: memcheck ($(date +%T))" >> $L
CUPYFLASH_FAMILY=mma_sync PYTHONPATH=. timeout 80 compute-sanitizer --tool memcheck python tests/sanitize_run.py 2>&1 | tail -2 >> $L
cd $S/..
save_new_kernels
echo "done ($(date +%T))" >> $L
