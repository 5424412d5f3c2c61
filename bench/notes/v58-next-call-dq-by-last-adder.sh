#!/bin/bash
# A device call (v58 for a later session; about 450 s warm): v58-dq-converted-by-last-adder.patch.
# The 64-row wgmma backwards (hd64/hd128 with causal, window, options or deterministic) convert each
# query block's dQ in the dQ adder's warp once the last key block has added to it (an acq_rel counter
# per query block, zeroed by flash_bwd_dot; the deterministic kernels' last turn), so that dq_accum is
# read back from L2 rather than DRAM and flash_bwd_convert_dq (54 us of a ~550 us hd128 1k causal
# backward in v8's profile) and its launch go. Rows that see no key get dQ = 0 in flash_bwd_dot.
# Prediction: 1k causal hd128 +5-8%, 4k causal +1-3%, 16k within noise; the 80-row non-causal
# control unchanged; deterministic cells likewise. Spill-free (the 80-row and hd64 128-row tiles
# keep the convert kernel: their producers spill with it). It conflicts with v58-dbias-zero-unseen-rows.patch
# in _plan.py (adjacent lines): each applies alone at HEAD.
# Trees: python bench/device_trees.py .device_scratch main=HEAD conv=HEAD+bench/notes/v58-dq-converted-by-last-adder.patch
#   --options '{"deterministic": true}' --options '{"softcap": 30.0}'
# then cp bench/notes/v58-next-call-dq-by-last-adder.sh .device_scratch/call.sh; run `bash .device_scratch/call.sh`, carry .device_scratch.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=128:1024:1,128:4096:1,128:16384:1,128:1024:0
echo "== ab bwd, main conv ($(date +%T))" >> $L
timeout 90 python /tmp/ab.py --pass bwd --rounds 5 --cells $C $S/main $S/conv >> $L 2>&1
for given in '{"deterministic": true}' '{"softcap": 30.0}'; do
  echo "== ab bwd $given, main conv ($(date +%T))" >> $L
  timeout 80 python /tmp/ab.py --pass bwd --rounds 3 --options "$given" --cells 128:1024:1,64:1024:1,128:4096:0 $S/main $S/conv >> $L 2>&1
done
echo "== conv: test_gpu.py and the deterministic and varlen tests ($(date +%T))" >> $L
(cd $S/conv && PYTHONPATH=. timeout 280 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py -k "not bias_tiles" > $OUT/tests_conv.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_conv.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_conv.log | head -10 >> $L
save_new_kernels
echo "done ($(date +%T))" >> $L
