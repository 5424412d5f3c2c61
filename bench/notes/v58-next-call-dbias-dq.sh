#!/bin/bash
# A device call (v58 for a later session; about 540 s warm): the two prepared backward patches in one
# call, each against HEAD (they conflict in _plan.py, so each is a tree of its own):
# v58-dbias-zero-unseen-rows.patch (`zero`: v58-next-call-dbias-zero.sh's header has its reason and
# prediction) and v58-dq-converted-by-last-adder.patch (`conv`: v58-next-call-dq-by-last-adder.sh's).
# Trees (the kernels are in .device_cache since v58): python bench/device_trees.py .device_scratch main=HEAD
#   zero=HEAD+bench/notes/v58-dbias-zero-unseen-rows.patch conv=HEAD+bench/notes/v58-dq-converted-by-last-adder.patch
#   --options '{"attn_bias": "random"}' --options '{"deterministic": true}' --options '{"softcap": 30.0}'
# then cp bench/notes/v58-next-call-dbias-dq.sh .device_scratch/call.sh; run `bash .device_scratch/call.sh`, carry .device_scratch.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
echo "== ab bwd, a (b,h,s,s) bias with dbias, main zero ($(date +%T))" >> $L
timeout 100 python /tmp/ab.py --pass bwd --rounds 3 --options '{"attn_bias": "random", "return_dbias": true}' \
  --cells 128:4096:1,64:4096:1,128:1024:1,128:4096:0 $S/main $S/zero >> $L 2>&1
echo "== ab bwd, main conv ($(date +%T))" >> $L
timeout 80 python /tmp/ab.py --pass bwd --rounds 5 --cells 128:1024:1,128:4096:1,128:16384:1,128:1024:0 $S/main $S/conv >> $L 2>&1
echo "== ab bwd deterministic and softcap, main conv ($(date +%T))" >> $L
for given in '{"deterministic": true}' '{"softcap": 30.0}'; do
  timeout 60 python /tmp/ab.py --pass bwd --rounds 3 --options "$given" --cells 128:1024:1,64:1024:1 $S/main $S/conv >> $L 2>&1
done
echo "== zero: bias tests ($(date +%T))" >> $L
(cd $S/zero && PYTHONPATH=. timeout 90 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py tests/test_torch_options.py -k "bias" > $OUT/tests_zero.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_zero.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_zero.log | head -10 >> $L
echo "== conv: test_gpu.py ($(date +%T))" >> $L
(cd $S/conv && PYTHONPATH=. timeout 200 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_gpu.py > $OUT/tests_conv.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_conv.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_conv.log | head -10 >> $L
save_new_kernels
echo "done ($(date +%T))" >> $L
