#!/bin/bash
# A device call (v56 for the next session; about 330 s warm): the attn_bias kernels with room in the
# L1 (v56-bias-l1-room.patch). An SM's L1 is what its shared memory leaves of 256 KiB: beside hd128's
# forward tiles (227 KiB) it has 28 KiB, less than the 32 KiB bias tile a block's prefetch asks for,
# and hd128's 64-row backward tiles ask 56 bytes over the 196 KiB carveout, so theirs has 28 too. The
# patch: a wgmma forward that reads a bias keeps two stages and no O buffer (193 KiB, L1 60), a wgmma
# backward without dropout holds no dropout words (194 KiB, L1 60), and every wgmma kernel asks the
# driver for no more shared memory than its one CTA an SM needs.
# Predictions: hd128's bias forward 2.11x plain -> 1.8-1.9x, its bias backward 4.2-4.5x -> ~3.5x;
# hd64 and hd256 and the plain kernels within noise.
# Trees: python bench/device_trees.py .device_scratch main=HEAD l1=HEAD+bench/notes/v56-bias-l1-room.patch --options '{"attn_bias": "random"}'
# Copy into .device_scratch/ and run as `bash .device_scratch/bias.sh` (carry .device_scratch).
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
C=128:4096:0,128:4096:1,128:16384:0,128:1024:0,64:4096:0,256:4096:0
echo "== ab fwd with attn_bias, main l1 ($(date +%T))" >> $L
timeout 120 python /tmp/ab.py --pass fwd --rounds 5 --options '{"attn_bias": "random"}' --cells $C $S/main $S/l1 >> $L 2>&1
echo "== ab bwd with attn_bias, main l1 ($(date +%T))" >> $L
timeout 150 python /tmp/ab.py --pass bwd --rounds 3 --options '{"attn_bias": "random"}' --cells 128:4096:0,128:4096:1,128:1024:1,64:4096:0 $S/main $S/l1 >> $L 2>&1
echo "== ab plain fwd and bwd, main l1 (the denominators; the plain kernels' carveout) ($(date +%T))" >> $L
timeout 60 python /tmp/ab.py --pass fwd --rounds 3 --cells $C $S/main $S/l1 >> $L 2>&1
timeout 60 python /tmp/ab.py --pass bwd --rounds 3 --cells 128:4096:0,128:4096:1,128:1024:1,64:4096:0 $S/main $S/l1 >> $L 2>&1
echo "== l1: bias GPU tests ($(date +%T))" >> $L
(cd $S/l1 && PYTHONPATH=. timeout 150 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py tests/test_torch_options.py -k "bias" > $OUT/tests_l1.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_l1.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_l1.log | head -10 >> $L
save_new_kernels
echo "done ($(date +%T))" >> $L
