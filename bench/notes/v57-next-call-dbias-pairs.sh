#!/bin/bash
# A device call (v57 for the next session; about 250 s warm): the wgmma backward's dbias two keys a lane
# (v57-dbias-pairs.patch): its A/B with dbias asked (a full bf16 bias: 4-byte stores; a key mask's:
# fp32 vector reductions) and the bias tests. Prediction: the bias backward with dbias +10-25%
# (its 2-byte stores and scalar atomics halved; the stores' sectors filled twice as far).
# Trees: python bench/device_trees.py .device_scratch main=HEAD pairs=HEAD+bench/notes/v57-dbias-pairs.patch --options '{"attn_bias": "random"}'
# then cp bench/notes/v57-next-call-dbias-pairs.sh .device_scratch/call.sh; run `bash .device_scratch/call.sh`, carry .device_scratch.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=128:4096:0,128:4096:1,64:4096:0,128:1024:1
echo "== ab bwd, a (b,h,s,s) bias with dbias, main pairs ($(date +%T))" >> $L
timeout 120 python /tmp/ab.py --pass bwd --rounds 3 --options '{"attn_bias": "random", "return_dbias": true}' --cells $C $S/main $S/pairs >> $L 2>&1
echo "== ab bwd, a (b,1,1,s) bias with dbias (fp32 reductions), main pairs ($(date +%T))" >> $L
timeout 90 python /tmp/ab.py --pass bwd --rounds 3 --options '{"attn_bias": "padding", "return_dbias": true}' --cells $C $S/main $S/pairs >> $L 2>&1
echo "== pairs: bias tests ($(date +%T))" >> $L
(cd $S/pairs && PYTHONPATH=. timeout 150 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py tests/test_torch_options.py -k "bias" > $OUT/tests_pairs.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_pairs.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_pairs.log | head -10 >> $L
save_new_kernels
echo "done ($(date +%T))" >> $L
