#!/bin/bash
# A device call (v72; about 9 min): softcap's forwards with some exps on the FMA pipe.
# Under softcap's fixed maximum (v49) a step issues a tanh and an exp a score on the special-function
# unit: at hd128 2 x 128 MUFU a scheduler a step, 8 clocks each = 2048 clocks, exactly the step's
# wgmma time; at hd64 (three consumers) 3072 against 1536. Measured: softcap 1.20-1.29x plain at
# hd128, 1.52x at hd64. exp2_on_fma (common/ptx.cuh) is 2^x from three FADDs, a cubic and an LEA
# (relative error 7.5e-5); unmasked blocks whose exponents all lie in [-120, 40] (softcap_exponents_fit:
# a span of at most 60, both dtypes) take every 2nd (fma2) or 4th (fma4) column tile's exps there
# (bf16's bounded step 481 -> 677 / 593 instructions at hd128).
# Prediction: hd128 softcap 1.20-1.29x -> 1.03-1.10x plain in both (fma4 a little ahead: fewer
# instructions, the MUFU at 1792 of 2048); hd64 1.52x -> 1.15-1.25x with fma2, less with fma4 (its
# MUFU still 2688 of 1536); no change without softcap (the control) or at hd256 (not applied).
# Against it: v36's power cap (energy per FLOP orders the cells), and each moved exp is 8 FMA-pipe
# instructions for one MUFU: if the bursts run at the cap, fma4 keeps more of the gain than fma2.
# Trees: device_trees.py .device_scratch18 main=HEAD fma2=HEAD+bench/notes/v72-fwd-softcap-exps-on-fma-2.patch
#   fma4=HEAD+bench/notes/v72-fwd-softcap-exps-on-fma-4.patch --kernels ab --dtypes bfloat16 float16
#   --options '{"softcap": 30.0}';
#   carry .device_scratch18. The tests compile their other kernels here.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch18 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=64:4096:0,64:16384:0,128:4096:0,128:16384:0,128:4096:1,128:16384:1,256:16384:0
for run in 'bfloat16|{"softcap": 30.0}|'$C 'float16|{"softcap": 30.0}|64:16384:0,128:4096:0,128:16384:0,128:16384:1' \
           'bfloat16|{}|64:16384:0,128:16384:0,128:16384:1'; do
  IFS='|' read dtype given cells <<< "$run"
  echo "== ab fwd $dtype $given" >> $L
  timeout 100 python /tmp/ab.py --pass fwd --dtype $dtype --rounds 5 --cells $cells --options "$given" \
    $S/main $S/fma2 $S/fma4 $S/main 2>&1 | tee -a $OUT/ab.txt | tail -9 >> $L
done
# Both trees' softcap tests (HEAD's new spans past 60 and 80 among them).
for tree in fma2 fma4; do
  gpu_tests $tree tests_$tree 60 tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k softcap
done
cat $L
