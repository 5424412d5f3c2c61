#!/bin/bash
# A device call (v60 for a later session; about 420 s warm): the dbias zeroing's GPU tests (v58's
# patch, +12-16% measured in v60 and backed out until they pass), the dQ conversion with its count a
# step late (v60's patch, on top of the zeroing: the adder counts a block once that step's successor
# is issued, cp.async.bulk.wait_group 1, instead of waiting for each step's reductions), and the
# backward's pair groups of one pair (FA4's order of key blocks).
# Prediction (conv): v59's patch lost 5-20% where the adder waited for each step's reductions and
# gained 4-6% in the deterministic kernels, which wait anyway: counted a step late, +3-6% at 1k
# causal, +1-3% at 4k, the 80-row control unchanged. (g1): within 2%; FA4's 10% lead at hd64 1k
# causal (v60's ncu: same instructions and bytes) is not the grid's order if so.
# Trees: python bench/device_trees.py .device_scratch main=HEAD zero=HEAD+bench/notes/v58-dbias-zero-unseen-rows.patch
#   conv=HEAD+bench/notes/v58-dbias-zero-unseen-rows.patch+bench/notes/v60-dq-converted-counted-a-step-late.patch
#   g1=HEAD+bench/notes/v60-backward-pair-groups-of-one.patch --options '{"attn_bias": "random"}' --options '{"deterministic": true}'
# then cp bench/notes/v60-next-call-zero-conv.sh .device_scratch/call.sh; run `bash .device_scratch/call.sh`,
# carry .device_scratch. Then at once bench/notes/v60-next-call-stalls-1k.sh (about 120 s).
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
for family in default mma_sync; do
  echo "== zero, $family family: bias tests ($(date +%T))" >> $L
  [ $family = mma_sync ] && export CUPYFLASH_FAMILY=mma_sync
  gpu_tests zero tests_zero_$family 100 tests/test_gpu.py tests/test_gpu_variants.py tests/test_torch_options.py -k "bias"
  unset CUPYFLASH_FAMILY
done
echo "== ab bwd, zero conv ($(date +%T))" >> $L
timeout 80 python /tmp/ab.py --pass bwd --rounds 5 --cells 128:1024:1,64:1024:1,64:1024:0,128:4096:1,64:4096:0,128:16384:1,128:1024:0 \
  $S/zero $S/conv >> $L 2>&1
echo "== ab bwd deterministic, zero conv ($(date +%T))" >> $L
timeout 30 python /tmp/ab.py --pass bwd --rounds 3 --options '{"deterministic": true}' --cells 64:1024:1,128:1024:1 $S/zero $S/conv >> $L 2>&1
echo "== conv: the tests that cover it ($(date +%T))" >> $L
gpu_tests conv tests_conv 110 tests/test_gpu.py -k "converts_dq or pair_groups or no_key or full_and_the_edged or bias"
echo "== ab bwd, main g1 (pair groups of one pair) ($(date +%T))" >> $L
timeout 30 python /tmp/ab.py --pass bwd --rounds 3 --cells 64:1024:1,128:1024:1 $S/main $S/g1 >> $L 2>&1
save_new_kernels
echo "done ($(date +%T))" >> $L
