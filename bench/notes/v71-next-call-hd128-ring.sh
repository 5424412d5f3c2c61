#!/bin/bash
# A device call (v71; about 8 min): HEAD's KV-cache GPU files first (v70 moved the decode plan's
# choices into _kvcache.decode_layout; no GPU has run it), then: does the depth of the K/V ring
# pace the hd128 forward on the H100? v70: FA4's hd128 16k forward gains ~4% from the H200 to the
# H100, ours does not (650 against 719 TFLOP/s), as if ours waited on something that does not speed
# up with the SM clock; three stages of 128 keys cover a fixed time in microseconds, less of a
# block's as the clock rises.
#   s2: the plain hd128 forward on two stages (`v71-hd128-fwd-s2.patch`);
#   n96s4: on four stages of 96 keys (`v71-hd128-fwd-n96s4.patch`: a 'fwd' entry and wgmma_ss for
#     N = 96; 225 KiB of shared memory, spill-free);
#   l3: the LOCAL forward past 1k rows on three stages and one Q buffer (`v71-hd128-local-three-stages.patch`;
#     its every-feature kernel spills 8 bytes in fp16, so landing it needs the options kept on two).
# Prediction: if the ring paces it, s2 loses 3% or more at 4k and 16k and n96s4 gains; if not, s2
# within 1% and n96s4 1-2% slower (v26: a 176-key block saved ~1% of per-block cost at hd128).
# The causal cells are the control of s2 and n96s4 (the LOCAL table, unchanged there) and l3's
# test: the LOCAL step is the plain one's (519 instructions against 502-510), yet v61 read LOCAL on
# plain work 2.5-4.5% slower, part of it its two stages (v27: two Q buffers even with three stages
# from 4k on, on the H200). Predicted for l3: 4k and 16k causal +1-3% if s2 loses, else within 1%.
# Trees: device_trees.py .device_scratch16 main=HEAD s2=HEAD+bench/notes/v71-hd128-fwd-s2.patch
#   n96s4=HEAD+bench/notes/v71-hd128-fwd-n96s4.patch l3=HEAD+bench/notes/v71-hd128-local-three-stages.patch
#   --kernels kvcache --dtypes bfloat16 float16; carry .device_scratch16.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch16 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests main kvcache_tests 170 tests/test_kvcache_gpu.py tests/test_torch_kvcache.py
C=128:4096:0,128:16384:0,128:16384:0:65536,128:4096:1,128:16384:1
timeout 220 python /tmp/ab.py --pass fwd --rounds 5 --cells $C $S/main $S/s2 $S/n96s4 $S/l3 $S/main \
  2>&1 | tee $OUT/ab.txt | tail -7 >> $L
# n96s4's long hd128 forward against the float64 reference (the GPU tests' long calls are causal or
# other head dims): 96-key blocks, a partial last one, GQA, both dtypes.
(cd $S/n96s4 && PYTHONPATH=. timeout 90 python -c "
from cupyflash import _check
for case in (_check.Case(2000, 2000, 128, 'bfloat16', False, nheads=4, nheads_k=2),
             _check.Case(1100, 1500, 128, 'float16', False, batch=2, nheads=2),
             _check.Case(4096, 4096, 128, 'bfloat16', False, nheads=2)):
    result = _check.run_gpu_case(case, 7, backward=False)
    print('ok  ' if result.ok else 'FAIL', case, '' if result.ok else result.describe())
" > $OUT/n96s4_check.log 2>&1); echo "n96s4 check rc $?" >> $L; cat $OUT/n96s4_check.log >> $L
cat $L
