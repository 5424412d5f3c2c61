#!/bin/bash
# A device call (v76; about 8 min; carry [".device_scratch24"]): the backward's mask before its exps.
# The sm90 backward masks P^T after exponentiating S^T, behind a branch on the block's `masked`
# flag; ptxas schedules within basic blocks, so each step's last 18-20 exps issue back to back (8
# cycles each, nothing beside them) before that branch. v76-bwd-mask-before-the-exps.patch hides
# the unseen scores as -inf before the exps (lse_log2 is +inf only for rows that see no key: every
# such P is 0, as before), so the branch comes first and the exps share a block with what follows.
# `bench/sass.py stalls`: the step's static stall cycles hd128 1187 -> 1018 (80-row 1319 -> 1147),
# hd64 1690 -> 1442, hd256 within 1-5%; every sm_90a backward variant (71) spill-free.
# Prediction: the same bits; backward +2-6% at hd64 and hd128 (fewer a consumer's cycles between
# its products), hd256 within 1%. v49's forward "flat" (a similar unblocking) lost 1-8%, so a loss
# is possible: judge by the A/B.
# Trees: device_trees.py .device_scratch24 main=HEAD mask=HEAD+bench/notes/v76-bwd-mask-before-the-exps.patch
#   --kernels all --named bench/device-test-kernels.txt --dtypes bfloat16 float16 (11 MB).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch24 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
echo "== same bits (main, mask)" >> $L
for tree in main mask; do
  (cd $S/$tree && PYTHONPATH=. timeout 150 python $OLDPWD/bench/notes/v74-same-bits.py write /tmp/bits-$tree.npz) >> $L 2>&1
done
python bench/notes/v74-same-bits.py compare /tmp/bits-main.npz /tmp/bits-mask.npz 2>&1 | head -8 >> $L
C=128:1024:0,128:1024:1,128:4096:0,128:4096:1,128:16384:0,128:16384:1,64:4096:0,64:16384:0,64:16384:1,256:16384:0
echo "== ab bwd bfloat16" >> $L
timeout 150 python /tmp/ab.py --pass bwd --rounds 5 --cells $C $S/main $S/mask $S/main $S/mask 2>&1 | tee -a $OUT/ab.txt | tail -13 >> $L
echo "== GPU tests of mask (test_gpu.py, test_head_dims.py)" >> $L
gpu_tests mask tests 250 tests/test_gpu.py tests/test_head_dims.py
cat $L
