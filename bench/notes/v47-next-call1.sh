#!/bin/bash
# Next call 1 (prepared in v47, kept through v48: sessions without a device): the decode experiments with their tests.
#   main = HEAD, small = + v46-decode-small-tile-for-clusters.experiment.patch,
#   mw = + v47-decode-cluster-merge-weights-once.patch, smallmw = both (trees in .device_scratch,
#   every sm_90 variant of each in cache.tar.xz, spill-free). test_kvcache_gpu.py holds v47's new
#   paged varlen tests too (JAX under jit, torch captured in a graph). corr (v48's softmax patch, which
#   changes the decode kernel too) joins the decode A/B; its tests are in call 2. About 340 s.
# Copy into .device_scratch/ and run as `bash .device_scratch/next_call1.sh`.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
for t in mw smallmw; do
  echo "== $t: KV-cache GPU tests ($(date +%T))" >> $L
  cd $S/$t
  PYTHONPATH=. timeout 70 python -m pytest -m gpu -p no:cacheprovider -n 12 -v -p no:warnings tests/test_kvcache_gpu.py \
    tests/test_torch_kvcache.py > $OUT/tests_$t.log 2>&1
  echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_$t.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_$t.log | head -10 >> $L
done
cd $S/..
echo "== ab decode main small mw smallmw corr: few-CTA short caches, and cells that merge in clusters on main ($(date +%T))" >> $L
C=1:1024:32:32:64:dense,1:1024:32:8:64:dense,1:1024:32:8:128:dense,1:1024:8:1:64:dense,1:1024:8:1:128:dense,4:1024:32:8:64:dense,4:4096:8:1:128:dense,16:1024:8:1:64:dense,16:1024:8:1:64:paged256,4:1024:32:32:128:dense,1:4096:32:8:128:dense,4:4096:32:8:64:dense,16:4096:8:1:128:dense,1:4096:8:1:64:dense,128:1024:8:1:64:dense,1:1024:32:8:128:paged16,64:1024:8:1:128:paged16,4:1024:8:1:128:paged16
timeout 190 python /tmp/ab.py --pass decode --rounds 3 --cells $C $S/main $S/small $S/mw $S/smallmw $S/corr >> $L 2>&1
save_new_kernels
echo "done ($(date +%T))" >> $L
