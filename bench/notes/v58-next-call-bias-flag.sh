#!/bin/bash
# A device call (v58; about 480 s warm): the bias tiles as a kernel flag (HEAD): float32 biases back on
# the kernels without a ring (against 8467e81, before the ring, and c8aa60a, its run-time fallback),
# 16-bit ones on the ring's kernels without the run-time branch (against c8aa60a); the bias tests of
# both families; memcheck and racecheck of the ring's kernels.
# Trees: python bench/device_trees.py .device_scratch before=8467e81 prev=c8aa60a main=HEAD
#   --options '{"attn_bias": "random"}' --options '{"attn_bias": "random_float32"}'
# then cp bench/notes/v58-next-call-bias-flag.sh .device_scratch/call.sh and
# cp bench/notes/v57-memcheck-bias.py .device_scratch/memcheck_bias.py; run `bash .device_scratch/call.sh`, carry .device_scratch.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=128:4096:0,128:4096:1,64:4096:0,128:1024:1
for form in padding_float32 random_float32; do
  echo "== ab fwd and bwd, a $form bias, before prev main ($(date +%T))" >> $L
  timeout 80 python /tmp/ab.py --pass fwd --rounds 3 --options "{\"attn_bias\": \"$form\"}" --cells $C $S/before $S/prev $S/main >> $L 2>&1
  timeout 100 python /tmp/ab.py --pass bwd --rounds 3 --options "{\"attn_bias\": \"$form\"}" --cells $C $S/before $S/prev $S/main >> $L 2>&1
done
echo "== ab fwd and bwd, a (b,h,s,s) bf16 bias, prev main ($(date +%T))" >> $L
timeout 60 python /tmp/ab.py --pass fwd --rounds 3 --options '{"attn_bias": "random"}' --cells $C $S/prev $S/main >> $L 2>&1
timeout 60 python /tmp/ab.py --pass bwd --rounds 3 --options '{"attn_bias": "random"}' --cells $C $S/prev $S/main >> $L 2>&1
for family in default mma_sync; do
  echo "== main, $family family: bias tests ($(date +%T))" >> $L
  [ $family = mma_sync ] && export CUPYFLASH_FAMILY=mma_sync
  (cd $S/main && PYTHONPATH=. timeout 120 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
    tests/test_gpu.py tests/test_gpu_variants.py tests/test_torch_options.py -k "bias or short_and_the_long" > $OUT/tests_$family.log 2>&1)
  echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_$family.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_$family.log | head -10 >> $L
  unset CUPYFLASH_FAMILY
done
for tool in memcheck racecheck; do
  echo "== $tool ($(date +%T))" >> $L
  (cd $S/main && PYTHONPATH=. timeout 100 compute-sanitizer --tool $tool --print-limit 5 python $S/memcheck_bias.py >> $L 2>&1)
  echo "rc $?" >> $L
done
save_new_kernels
echo "done ($(date +%T))" >> $L
