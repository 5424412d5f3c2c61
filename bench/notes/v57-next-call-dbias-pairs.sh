#!/bin/bash
# A device call (v57 for the next session; about 450 s warm): two patches of the wgmma bias backward,
# v57-dbias-pairs.patch (dbias two keys a lane: a full bf16 bias's 4-byte stores, a key mask's fp32
# vector reductions) and v57-bwd-bias-early-probabilities.patch (P^T while dP^T's product runs, as
# the plain kernels, where the bias comes from its ring): A/Bs with and without dbias, the bias tests.
# Predictions: dbias pairs +10-25% with dbias (its 2-byte stores and scalar atomics halved); early
# probabilities +3-8% (the plain kernels' overlap), both spill-free.
# Also: float32 biases beside 8467e81 (v57's tile kernels read a bias they cannot map element by
# element, without the L1 prefetch the two-consumer forwards had: a regression there is unmeasured).
# Trees: python bench/device_trees.py .device_scratch before=8467e81 main=HEAD pairs=HEAD+bench/notes/v57-dbias-pairs.patch
#   early=HEAD+bench/notes/v57-bwd-bias-early-probabilities.patch --options '{"attn_bias": "random"}'
# then cp bench/notes/v57-next-call-dbias-pairs.sh .device_scratch/call.sh; run `bash .device_scratch/call.sh`, carry .device_scratch.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=128:4096:0,128:4096:1,64:4096:0,128:1024:1
for form in padding_float32 random_float32; do
  echo "== ab fwd and bwd, a $form bias, before main ($(date +%T))" >> $L
  timeout 60 python /tmp/ab.py --pass fwd --rounds 3 --options "{\"attn_bias\": \"$form\"}" --cells $C $S/before $S/main >> $L 2>&1
  timeout 90 python /tmp/ab.py --pass bwd --rounds 3 --options "{\"attn_bias\": \"$form\"}" --cells $C $S/before $S/main >> $L 2>&1
done
echo "== ab bwd, a (b,h,s,s) bias, main early ($(date +%T))" >> $L
timeout 90 python /tmp/ab.py --pass bwd --rounds 3 --options '{"attn_bias": "random"}' --cells $C $S/main $S/early >> $L 2>&1
echo "== ab bwd, a (b,h,s,s) bias with dbias, main pairs early ($(date +%T))" >> $L
timeout 150 python /tmp/ab.py --pass bwd --rounds 3 --options '{"attn_bias": "random", "return_dbias": true}' --cells $C $S/main $S/pairs $S/early >> $L 2>&1
echo "== ab bwd, a (b,1,1,s) bias with dbias (fp32 reductions), main pairs ($(date +%T))" >> $L
timeout 90 python /tmp/ab.py --pass bwd --rounds 3 --options '{"attn_bias": "padding", "return_dbias": true}' --cells $C $S/main $S/pairs >> $L 2>&1
for t in pairs early; do
  echo "== $t: bias tests ($(date +%T))" >> $L
  (cd $S/$t && PYTHONPATH=. timeout 120 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
    tests/test_gpu.py tests/test_gpu_variants.py tests/test_torch_options.py -k "bias" > $OUT/tests_$t.log 2>&1)
  echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_$t.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_$t.log | head -10 >> $L
done
save_new_kernels
echo "done ($(date +%T))" >> $L
