#!/bin/bash
# A device call (v57): bias tiles with one broadcast row (HEAD) and the backward's (bwdt): tests, memcheck, the
# key-mask and full-bias A/Bs beside 8467e81; hd64's bias forward on two consumers (its LOCAL kernel spills).
# Trees: python bench/device_trees.py .device_scratch main=8467e81 tiles=HEAD hd64b=HEAD+bench/notes/v57-hd64-bias-two-consumers.patch
#   bwdt=HEAD+bench/notes/v57-bwd-bias-tiles.patch --options '{"attn_bias": "random"}'
# then cp bench/notes/v57-memcheck-bias.py .device_scratch/memcheck_bias.py and this script to .device_scratch/; carry .device_scratch.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=128:4096:0,128:4096:1,64:4096:0,256:4096:0,128:1024:1
echo "== ab fwd with a (b,1,1,s) bias, main tiles ($(date +%T))" >> $L
timeout 45 python /tmp/ab.py --pass fwd --rounds 3 --options '{"attn_bias": "padding"}' --cells $C $S/main $S/tiles >> $L 2>&1
echo "== ab fwd with a (b,h,s,s) bias at hd64, main tiles hd64b ($(date +%T))" >> $L
timeout 50 python /tmp/ab.py --pass fwd --rounds 3 --options '{"attn_bias": "random"}' --cells 64:4096:0,64:16384:1,64:1024:1 $S/main $S/tiles $S/hd64b >> $L 2>&1
echo "== ab bwd with a (b,h,s,s) bias, main tiles bwdt ($(date +%T))" >> $L
timeout 120 python /tmp/ab.py --pass bwd --rounds 3 --options '{"attn_bias": "random"}' --cells 128:4096:0,128:4096:1,64:4096:0,128:1024:1 $S/main $S/tiles $S/bwdt >> $L 2>&1
echo "== bwdt: bias tests ($(date +%T))" >> $L
(cd $S/bwdt && PYTHONPATH=. timeout 150 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py tests/test_torch_options.py -k "bias" > $OUT/tests_tiles.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_tiles.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_tiles.log | head -10 >> $L
echo "== memcheck ($(date +%T))" >> $L
(cd $S/bwdt && PYTHONPATH=. timeout 80 compute-sanitizer --tool memcheck --print-limit 5 python $S/memcheck_bias.py >> $L 2>&1)
echo "rc $?" >> $L
save_new_kernels
echo "done ($(date +%T))" >> $L
