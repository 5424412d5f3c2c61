#!/bin/bash
# Next call 2 (prepared in v47, v48's experiments added; sessions without a device): the forward's
# softmax schedule beside FA4's (v48 note: FA4's hd64 loop interleaves every exp with other work;
# ours issues runs of 33 exps behind a branch):
#   half = HEAD + v46-fwd-half-diagonal-pv.patch (LOCAL forwards: P V on half a causal diagonal),
#   corr = HEAD + v48-softmax-corrections-when-moved.patch (the corrections' exps only where a
#          row's maximum moved: 64 exps a block, not 66; ptxas then waits for P V after the exps),
#   flat = HEAD + v48-softmax-rescale-without-branch.patch (the wgmma forward rescales O every
#          block without a branch: one basic block, every exp interleaved, as FA4's).
# An A/B of main, half, corr and flat first, then corr's and flat's forward tests side by side
# (half's are in call 2b). About 360 s.
cd "$(dirname "$0")/.."
source bench/device_call.sh
echo "== ab fwd main half corr flat ($(date +%T))" > $L
timeout 210 python /tmp/ab.py --pass fwd --rounds 5 $S/main $S/half $S/corr $S/flat >> $L 2>&1
echo "== corr (forward and decode tests) and flat (forward tests), side by side ($(date +%T))" >> $L
(cd $S/corr && PYTHONPATH=. timeout 140 python -m pytest -m gpu -p no:cacheprovider -n 6 -q -p no:warnings \
  tests/test_gpu.py tests/test_head_dims.py tests/test_kvcache_gpu.py \
  -k "causal or local or window or tile_table or forward or dense_decode or splits" \
  > $OUT/tests_corr.log 2>&1; echo "corr rc $?" >> $OUT/tests_corr.log) &
(cd $S/flat && PYTHONPATH=. timeout 140 python -m pytest -m gpu -p no:cacheprovider -n 6 -q -p no:warnings \
  tests/test_gpu.py tests/test_head_dims.py -k "causal or local or window or tile_table or forward" \
  > $OUT/tests_flat.log 2>&1; echo "flat rc $?" >> $OUT/tests_flat.log) &
wait
for t in corr flat; do
  echo "-- $t ($(date +%T))" >> $L; tail -2 $OUT/tests_$t.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_$t.log | head -10 >> $L
done
cd $S/..
save_new_kernels
echo "done ($(date +%T))" >> $L
