#!/bin/bash
# A device call (v74; about 8 min; carry [".device_scratch21"]): the forward's exps beside its own
# warpgroup's P V. At HEAD ptxas lifts the P V's wait (WARPGROUP.DEPBAR.LE gsb0, 0x0) to the top of
# its basic block, above every exp (`bench/sass.py`: 0 of 66 exps before it at hd64 and hd128, 0 of
# 42 at hd256, in every sm_90a forward), so each consumer's block runs Q K^T, then P V, then its exps
# in series; FA3/FA4 run the exps while P V does. v74-fwd-exps-before-the-pv-wait.patch puts the wait
# in both arms of a branch on O's rescale flag (`wait_in_branch`; the carried first block too), after the exps: 66 of 66 before it in every
# kernel, spill-free, the same ptxas messages. The same operations in the same order, so the same bits.
# Prediction (the note's static budget: a consumer's chain from S landing to its next Q K^T queued,
# HEAD against the patch): hd128 +3-8% (1495 of 1536 clocks at HEAD, 1192 patched), hd256 +0-4%
# (1653 of 1920, 1305), hd64 within 2% (1128 of 1280, 1086; its special-function unit co-limits);
# softcap at hd128 as much or more.
# Trees: device_trees.py .device_scratch21 main=HEAD exps=HEAD+bench/notes/v74-fwd-exps-before-the-pv-wait.patch
#   dk=HEAD+bench/notes/v74-bwd-dk-runs-into-the-next-step.patch
#   both=HEAD+bench/notes/v74-fwd-exps-before-the-pv-wait.patch+bench/notes/v74-bwd-dk-runs-into-the-next-step.patch
#   --kernels all --named bench/device-test-kernels.txt --dtypes bfloat16 float16 (16 MB).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch21 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
echo "== same bits (main, both; then exps and dk where they differ)" >> $L
bits() { (cd $S/$1 && PYTHONPATH=. timeout 150 python $OLDPWD/bench/notes/v74-same-bits.py write /tmp/bits-$1.npz) >> $L 2>&1; }
bits main; bits both
if ! python bench/notes/v74-same-bits.py compare /tmp/bits-main.npz /tmp/bits-both.npz >> $L 2>&1; then
  for tree in exps dk; do bits $tree; python bench/notes/v74-same-bits.py compare /tmp/bits-main.npz /tmp/bits-$tree.npz 2>&1 | head -8 >> $L; done
fi
for dtype in bfloat16 float16; do
  cells=128:1024:0,128:1024:1,128:4096:0,128:16384:0,128:4096:1,128:16384:1,256:1024:0,256:4096:0,256:16384:0,256:4096:1,64:4096:0,64:16384:0,64:4096:1,64:16384:1
  [ $dtype = float16 ] && cells=128:16384:0,128:16384:1,256:16384:0,64:16384:0
  echo "== ab fwd $dtype" >> $L
  timeout $([ $dtype = float16 ] && echo 60 || echo 200) python /tmp/ab.py --pass fwd --dtype $dtype --rounds 7 \
    --cells $cells $S/main $S/exps $S/main $S/exps 2>&1 | tee -a $OUT/ab.txt | tail -17 >> $L
done
echo "== ab fwd softcap" >> $L
timeout 60 python /tmp/ab.py --pass fwd --rounds 5 --options '{"softcap": 30.0}' --cells 128:4096:0,128:16384:0,128:16384:1,64:16384:0 \
  $S/main $S/exps $S/main $S/exps 2>&1 | tee -a $OUT/ab.txt | tail -6 >> $L
cat $L
