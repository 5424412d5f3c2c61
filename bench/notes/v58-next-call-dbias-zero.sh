#!/bin/bash
# A device call (v58 for a later session; about 250 s warm): v58-dbias-zero-unseen-rows.patch, the
# LOCAL wgmma backward's idle producer warps zeroing the dbias rows its key block skips instead of a
# memset of the whole (b,h,s,s) dbias before the backward (~0.7 ms at hd128 4k, batch 4, 16 heads).
# Prediction: causal bias backward with dbias +20-30% (v58: dbias costs 32% causal, 16% not), the
# non-causal control unchanged. Spill-free, no stack frame (the zeroing is a noinline function: inlined,
# it spilled the LOCAL hd128 kernel 16 bytes).
# Trees: python bench/device_trees.py .device_scratch main=HEAD zero=HEAD+bench/notes/v58-dbias-zero-unseen-rows.patch
#   --options '{"attn_bias": "random"}'
# then cp bench/notes/v58-next-call-dbias-zero.sh .device_scratch/call.sh; run `bash .device_scratch/call.sh`, carry .device_scratch.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=128:4096:1,64:4096:1,128:1024:1,256:4096:1,128:4096:0
echo "== ab bwd, a (b,h,s,s) bias with dbias, main zero ($(date +%T))" >> $L
timeout 120 python /tmp/ab.py --pass bwd --rounds 3 --options '{"attn_bias": "random", "return_dbias": true}' --cells $C $S/main $S/zero >> $L 2>&1
for family in default mma_sync; do
  echo "== zero, $family family: bias tests ($(date +%T))" >> $L
  [ $family = mma_sync ] && export CUPYFLASH_FAMILY=mma_sync
  (cd $S/zero && PYTHONPATH=. timeout 120 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
    tests/test_gpu.py tests/test_gpu_variants.py tests/test_torch_options.py -k "bias" > $OUT/tests_$family.log 2>&1)
  echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_$family.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_$family.log | head -10 >> $L
  unset CUPYFLASH_FAMILY
done
save_new_kernels
echo "done ($(date +%T))" >> $L
