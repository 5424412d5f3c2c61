#!/bin/bash
# v47 call 1 (prepared in v46): the half-P-V forward patch's LOCAL tests and A/B; the decode
# experiment (small tile for few-CTA short caches, so splits merge in clusters) A/B; then the
# forced mma.sync family's GPU files that v46 did not reach, and its memcheck.
#   main = HEAD, half = HEAD + bench/notes/v46-fwd-half-diagonal-pv.patch,
#   small = HEAD + bench/notes/v46-decode-small-tile-for-clusters.experiment.patch
cd "$(dirname "$0")/.."
mkdir -p /tmp/pcache && tar -xJf .device_scratch/cache.tar.xz -C /tmp/pcache --strip-components=1
export CUPYFLASH_CACHE_DIR=/tmp/pcache XLA_PYTHON_CLIENT_PREALLOCATE=false
touch /tmp/t0
cp bench/ab.py /tmp/
S=$PWD/.device_scratch
L=$OUT/log.txt
echo "== half: LOCAL forward tests ($(date +%T))" > $L
cd $S/half
PYTHONPATH=. timeout 150 python -m pytest -m gpu -p no:cacheprovider -n 12 -q -p no:warnings tests/test_gpu.py tests/test_head_dims.py \
  -k "causal or local or window or tile_table or forward" > $OUT/tests_half.log 2>&1
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_half.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_half.log | head -10 >> $L
cd $S/..
echo "== ab fwd main half ($(date +%T))" >> $L
timeout 100 python /tmp/ab.py --pass fwd --rounds 5 $S/main $S/half >> $L 2>&1
echo "== ab decode main small: few-CTA short caches ($(date +%T))" >> $L
C=1:1024:32:32:64:dense,1:1024:32:8:64:dense,1:1024:32:8:128:dense,1:1024:8:1:64:dense,1:1024:8:1:128:dense,4:1024:32:8:64:dense,4:4096:8:1:128:dense,16:1024:8:1:64:dense,16:1024:8:1:64:paged256,4:1024:32:32:128:dense,1:4096:32:8:128:dense,4:4096:32:8:64:dense,16:4096:8:1:128:dense,1:4096:8:1:64:dense,128:1024:8:1:64:dense
timeout 60 python /tmp/ab.py --pass decode --rounds 3 --cells $C $S/main $S/small >> $L 2>&1
echo "== main, forced mma_sync: the GPU files v46 did not reach ($(date +%T))" >> $L
cd $S/main
CUPYFLASH_FAMILY=mma_sync PYTHONPATH=. timeout 190 python -m pytest -m gpu -n 12 -v -p no:cacheprovider -p no:warnings \
  $(ls tests/test_*.py | grep -v -e test_gpu.py -e test_head_dims.py -e test_gpu_variants.py -e test_bench_context_parallel.py) \
  > $OUT/forced_rest.log 2>&1
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/forced_rest.log >> $L; grep -E "FAILED|ERROR" $OUT/forced_rest.log | head -20 >> $L
echo "== main, forced mma_sync: memcheck ($(date +%T))" >> $L
CUPYFLASH_FAMILY=mma_sync PYTHONPATH=. timeout 70 compute-sanitizer --tool memcheck python tests/sanitize_run.py 2>&1 | tail -2 >> $L
cd $S/..
find /tmp/pcache -newer /tmp/t0 -type f | tar -cJf $OUT/newcache.tar.xz -T - 2>/dev/null
echo "done ($(date +%T))" >> $L
