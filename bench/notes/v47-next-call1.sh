#!/bin/bash
# v48 call 1 (prepared in v47, no device that session): the experiments, with their tests.
#   main = HEAD (v47: mask.cuh's one range helper), half = + v46-fwd-half-diagonal-pv.patch,
#   small = + v46-decode-small-tile-for-clusters.experiment.patch, mw = + v47-decode-cluster-merge-weights-once.patch,
#   smallmw = small and mw together. Every sm_90 variant of each tree is in cache.tar.xz, spill-free.
# About 500 s: copy into .device_scratch/ and run as `bash .device_scratch/next_call1.sh`.
cd "$(dirname "$0")/.."
mkdir -p /tmp/pcache && tar -xJf .device_scratch/cache.tar.xz -C /tmp/pcache --strip-components=1
export CUPYFLASH_CACHE_DIR=/tmp/pcache XLA_PYTHON_CLIENT_PREALLOCATE=false
touch /tmp/t0
cp bench/ab.py /tmp/
S=$PWD/.device_scratch
L=$OUT/log.txt
echo "== half: LOCAL forward tests ($(date +%T))" > $L
cd $S/half
PYTHONPATH=. timeout 130 python -m pytest -m gpu -p no:cacheprovider -n 12 -q -p no:warnings tests/test_gpu.py tests/test_head_dims.py \
  -k "causal or local or window or tile_table or forward" > $OUT/tests_half.log 2>&1
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_half.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_half.log | head -10 >> $L
for t in mw smallmw; do
  echo "== $t: KV-cache GPU tests ($(date +%T))" >> $L
  cd $S/$t
  PYTHONPATH=. timeout 70 python -m pytest -m gpu -p no:cacheprovider -n 12 -q -p no:warnings tests/test_kvcache_gpu.py \
    tests/test_torch_kvcache.py > $OUT/tests_$t.log 2>&1
  echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_$t.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_$t.log | head -10 >> $L
done
cd $S/..
echo "== ab fwd main half ($(date +%T))" >> $L
timeout 100 python /tmp/ab.py --pass fwd --rounds 5 $S/main $S/half >> $L 2>&1
echo "== ab decode main small mw smallmw: few-CTA short caches, and cells that merge in clusters on main ($(date +%T))" >> $L
C=1:1024:32:32:64:dense,1:1024:32:8:64:dense,1:1024:32:8:128:dense,1:1024:8:1:64:dense,1:1024:8:1:128:dense,4:1024:32:8:64:dense,4:4096:8:1:128:dense,16:1024:8:1:64:dense,16:1024:8:1:64:paged256,4:1024:32:32:128:dense,1:4096:32:8:128:dense,4:4096:32:8:64:dense,16:4096:8:1:128:dense,1:4096:8:1:64:dense,128:1024:8:1:64:dense,1:1024:32:8:128:paged16,64:1024:8:1:128:paged16,4:1024:8:1:128:paged16
timeout 150 python /tmp/ab.py --pass decode --rounds 3 --cells $C $S/main $S/small $S/mw $S/smallmw >> $L 2>&1
find /tmp/pcache -newer /tmp/t0 -type f | tar -cJf $OUT/newcache.tar.xz -T - 2>/dev/null
echo "done ($(date +%T))" >> $L
