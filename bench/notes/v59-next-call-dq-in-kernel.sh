#!/bin/bash
# A device call (v59 for a later session; about 560 s warm; every timeout reached: 570 s): v59-dq-converted-in-kernel.patch (which
# supersedes v58-dq-converted-by-last-adder.patch) and v58-dbias-zero-unseen-rows.patch, each against
# HEAD (both touch _plan.py: a tree each). `conv`: the wgmma backwards up to hd128 but the 80-row tile
# convert dQ in the kernel: the last key block to add to a query block (a counter per block, zeroed
# by flash_bwd_dot) posts it to the producer's idle warps 2 and 3, which bulk-copy its dq_accum back
# from L2 in 16 KiB chunks and store dQ; flash_bwd_convert_dq (a DRAM read of all of dq_accum, ~55 us
# at 16k tokens x 2048 hidden) no longer runs after them. v58's patch converted in the adder's warp
# with one load in flight a lane (~15 us a block, which would have stalled the adder and the consumers).
# Prediction (conv): 1k causal hd128 and hd64 +7-10%, hd64 1k non-causal +5-7%, 4k +2-4%, 16k +0-1%;
# the 80-row control (128:1024:0) unchanged; deterministic and softcap 1k causal +5-9%. If a causal
# cell gains less: the heaviest CTA (key block 0) is the last adder of most query blocks, so its
# converters' work (~1.5 us a block) lengthens it. Prediction (zero): in v58-next-call-dbias-zero.sh.
# Trees: python bench/device_trees.py .device_scratch main=HEAD conv=HEAD+bench/notes/v59-dq-converted-in-kernel.patch
#   zero=HEAD+bench/notes/v58-dbias-zero-unseen-rows.patch
#   --options '{"attn_bias": "random"}' --options '{"deterministic": true}' --options '{"softcap": 30.0}'
# then cp bench/notes/v59-next-call-dq-in-kernel.sh .device_scratch/call.sh; run `bash .device_scratch/call.sh`,
# carry .device_scratch.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
echo "== conv: the backward tests that cover it first ($(date +%T))" >> $L
(cd $S/conv && PYTHONPATH=. timeout 120 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_gpu.py -k "converts_dq or full_and_the_edged or forward_backward or every_tile_table or pair_groups or no_key" \
  > $OUT/tests_conv_first.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_conv_first.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_conv_first.log | head -10 >> $L
echo "== ab bwd, main conv ($(date +%T))" >> $L
timeout 100 python /tmp/ab.py --pass bwd --rounds 5 --cells 128:1024:1,64:1024:1,64:1024:0,128:4096:1,64:4096:0,128:16384:1,128:1024:0 \
  $S/main $S/conv >> $L 2>&1
for given in '{"deterministic": true}' '{"softcap": 30.0}'; do
  echo "== ab bwd $given, main conv ($(date +%T))" >> $L
  timeout 60 python /tmp/ab.py --pass bwd --rounds 3 --options "$given" --cells 128:1024:1,64:1024:1 $S/main $S/conv >> $L 2>&1
done
echo "== ab bwd, a (b,h,s,s) bias with dbias, main zero ($(date +%T))" >> $L
timeout 90 python /tmp/ab.py --pass bwd --rounds 3 --options '{"attn_bias": "random", "return_dbias": true}' \
  --cells 128:4096:1,64:4096:1,128:1024:1,128:4096:0 $S/main $S/zero >> $L 2>&1
echo "== conv: the rest of test_gpu.py, test_gpu_variants.py ($(date +%T))" >> $L
(cd $S/conv && PYTHONPATH=. timeout 120 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py -k "not (converts_dq or full_and_the_edged or forward_backward or every_tile_table or pair_groups or no_key)" \
  > $OUT/tests_conv.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_conv.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_conv.log | head -10 >> $L
save_new_kernels
echo "done ($(date +%T))" >> $L
