#!/bin/bash
# A device call (v58; about 420 s warm): HEAD's test_gpu.py on the default family (the bias tiles as
# a kernel flag, the bias backward's early probabilities, the whole-waves decode rule), then v52's
# fewer-splits-in-clusters patch against HEAD again in 9 rounds on the cells it moved (-5% at
# 16 x 4k hd128 in v58's first run, +8-19% at 32 x 1k and the hd64 1k cells).
# Trees: python bench/device_trees.py .device_scratch main=HEAD --kernels all
# then cp bench/notes/v58-next-call-suite-clusters.sh .device_scratch/call.sh; run `bash .device_scratch/call.sh`, carry .device_scratch.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
echo "== main: test_gpu.py ($(date +%T))" >> $L
(cd $S/main && PYTHONPATH=. timeout 330 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_gpu.py > $OUT/tests_gpu.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_gpu.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_gpu.log | head -20 >> $L
rm -rf /tmp/wc && mkdir -p /tmp/wc && cp -r cupyflash cuda_src tests bench setup.cfg pyproject.toml /tmp/wc/
(cd /tmp/wc && git apply $PWD/bench/notes/v52-decode-fewer-splits-in-clusters.patch) >> $L 2>&1
echo "== ab decode: HEAD against fewer splits in clusters ($(date +%T))" >> $L
C=16:4096:8:1:128:dense,32:1024:8:1:128:dense,4:1024:32:8:64:dense,16:1024:8:1:64:dense,4:1024:32:8:128:paged16,16:1024:8:1:128:paged16
timeout 90 python /tmp/ab.py --pass decode --rounds 9 --cells $C $S/main /tmp/wc >> $L 2>&1
save_new_kernels
echo "done ($(date +%T))" >> $L
