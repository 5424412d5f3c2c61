#!/bin/bash
# A device call (v56 for the next session; about 250 s warm): the attn_bias forward with room in the
# L1 (v56-fwd-bias-l1-room.patch: a wgmma forward that reads a bias keeps two stages and no O
# buffer, and asks the driver for no more shared memory than its CTA needs, so that a block's bias
# tile, 32 KiB at hd128, fits the L1 its prefetch fills; beside hd128's 227 KiB the L1 has 28 KiB).
# Prediction: hd128's bias forward 2.11x plain -> 1.8-1.9x; hd64 (L1 already ~100 KiB) and hd256
# (unchanged tile) within noise. Then the bias GPU tests in that tree.
# Trees: python bench/device_trees.py .device_scratch main=HEAD l1=HEAD+bench/notes/v56-fwd-bias-l1-room.patch --options '{"attn_bias": "random"}'
# Copy into .device_scratch/ and run as `bash .device_scratch/bias.sh` (carry .device_scratch).
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
C=128:4096:0,128:4096:1,128:16384:0,128:1024:0,64:4096:0,256:4096:0
echo "== ab fwd with attn_bias, main l1 ($(date +%T))" >> $L
timeout 150 python /tmp/ab.py --pass fwd --rounds 5 --options '{"attn_bias": "random"}' --cells $C $S/main $S/l1 >> $L 2>&1
echo "== ab fwd plain, main (the ratio's denominator) ($(date +%T))" >> $L
timeout 60 python /tmp/ab.py --pass fwd --rounds 3 --cells $C $S/main >> $L 2>&1
echo "== l1: bias GPU tests ($(date +%T))" >> $L
(cd $S/l1 && PYTHONPATH=. timeout 150 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py tests/test_torch_options.py -k "bias" > $OUT/tests_l1.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_l1.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_l1.log | head -10 >> $L
save_new_kernels
echo "done ($(date +%T))" >> $L
