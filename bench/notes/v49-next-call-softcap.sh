#!/bin/bash
# Next call "softcap" (v49, a session without a device): softcap's bfloat16 forwards with a fixed
# maximum (softcap = HEAD + v49-softcap-fixed-maximum.patch: tanh bounds the scores, so no row
# maxima, corrections or rescale; hd128 step 570 -> 481 instructions, the plain kernel's 438).
# Its tests first on both families (the softcap cases of test_gpu, test_gpu_variants and
# test_head_dims; SOFTCAP_RANGE_CASES put every capped score of a row near +-cap, caps 30 to 100),
# then an A/B of the forward with softcap 30 and 50 and without (the control: the plain kernels
# are the same code in both trees). About 350 s.
cd "$(dirname "$0")/.."
source bench/device_call.sh
echo "== softcap: tests, wgmma and forced mma.sync side by side ($(date +%T))" > $L
cd $S/softcap
(PYTHONPATH=. timeout 150 python -m pytest -m gpu -p no:cacheprovider -n 7 -q -p no:warnings tests/test_gpu.py \
  tests/test_gpu_variants.py tests/test_head_dims.py -k "softcap" > $OUT/tests_softcap.log 2>&1
 echo "rc $?" >> $OUT/tests_softcap.log) &
(CUPYFLASH_FAMILY=mma_sync PYTHONPATH=. timeout 150 python -m pytest -m gpu -p no:cacheprovider -n 7 -q -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k "softcap" > $OUT/tests_softcap_mma.log 2>&1
 echo "rc $?" >> $OUT/tests_softcap_mma.log) &
wait
for t in softcap softcap_mma; do
  echo "-- $t ($(date +%T))" >> $L; tail -2 $OUT/tests_$t.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_$t.log | head -10 >> $L
done
cd $S/..
CELLS=64:16384:0,128:4096:0,128:16384:0,128:4096:1,256:16384:0
for run in '{"softcap": 30.0}|$CELLS' '{"softcap": 50.0}|128:4096:0,128:16384:0' '{}|$CELLS'; do
  given=${run%|*}; cells=$(eval echo ${run#*|})
  echo "== ab fwd main softcap $given ($(date +%T))" >> $L
  timeout 75 python /tmp/ab.py --pass fwd --rounds 3 --cells $cells --options "$given" $S/main $S/softcap >> $L 2>&1
done
save_new_kernels
echo "done ($(date +%T))" >> $L
