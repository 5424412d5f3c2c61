#!/bin/bash
# A device call (v55; about 300 s warm): the wgmma forward's bias asked of L2 a block (bias1) or two
# (bias2) ahead of its reads (v55-fwd-bias-l2-prefetch.patch; bias2 with kBiasL2Ahead = 2): the options' GPU tests and memcheck
# of bias forwards in bias1, then the attn_bias forward of main, bias1 and bias2 in turns (the options
# table's row: 2.11-2.13x the plain forward, bound about 1.7x; bench/notes/v55).
# Trees: python bench/device_trees.py .device_scratch3 --options '{"attn_bias": "random"}' main=HEAD
#   bias1=HEAD+bench/notes/v55-fwd-bias-l2-prefetch.patch bias2=HEAD+(the same with kBiasL2Ahead 2 at hd64/hd128)
# Copy into .device_scratch3/ and run as `bash .device_scratch3/call.sh` (carry .device_scratch3).
cd "$(dirname "$0")/.."
mkdir -p /tmp/pcache3 && tar -xJf .device_scratch3/cache.tar.xz -C /tmp/pcache3 --strip-components=1
export CUPYFLASH_CACHE_DIR=/tmp/pcache3
S=$PWD/.device_scratch3
L=$OUT/bias.txt
echo "== bias1: the options' GPU tests ($(date +%T))" > $L
(cd $S/bias1 && PYTHONPATH=. timeout 200 python -m pytest -m gpu -p no:cacheprovider -n 14 -q -p no:warnings \
  tests/test_gpu_variants.py > $OUT/tests_bias1.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_bias1.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_bias1.log | head -10 >> $L
echo "== bias1: memcheck of bias forwards ($(date +%T))" >> $L
(cd $S/bias1 && PYTHONPATH=. timeout 120 compute-sanitizer --tool memcheck python - <<'PY' 2>&1 | tail -4 >> $L
from cupyflash import _check
for case in (_check.Case(1000, 1000, 128, "bfloat16", True, attn_bias="full", nheads=2),
             _check.Case(113, 700, 64, "float16", False, attn_bias="heads", nheads=4, nheads_k=2),
             _check.Case(300, 1000, 128, "bfloat16", False, attn_bias="keys", batch=3)):
    print(_check.run_gpu_case(case, 5, backward=False))
PY
)
echo "== ab fwd attn_bias: main bias1 bias2 ($(date +%T))" >> $L
cp bench/ab.py /tmp/ab3.py
timeout 200 python /tmp/ab3.py --options '{"attn_bias": "random"}' --rounds 5 \
  --cells 128:4096:0,128:16384:0,128:4096:1,128:1024:0,64:1024:0 $S/main $S/bias1 $S/bias2 >> $L 2>&1
echo "== ab fwd plain (controls): main bias1 ($(date +%T))" >> $L
timeout 60 python /tmp/ab3.py --rounds 3 --cells 128:4096:0,64:4096:0 $S/main $S/bias1 >> $L 2>&1
echo "done ($(date +%T))" >> $L
