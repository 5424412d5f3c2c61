#!/bin/bash
# A device call (v78; about 3 min; carry [".device_scratch27"]): the LOCAL deterministic kernels walking
# their query blocks down (v78-det-local-down.patch, the adder as HEAD has it) beside HEAD:
# same bits (but the LOCAL deterministic dk and dv, whose
# steps' order changed), the deterministic A/B, and the deterministic and hd64 options' GPU tests.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch27 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
echo "== same bits (main, R)" >> $L
for tree in main R; do
  (cd $S/$tree && PYTHONPATH=. timeout 120 python $OLDPWD/bench/notes/v74-same-bits.py write /tmp/bits-$tree.npz) >> $L 2>&1
done
python bench/notes/v74-same-bits.py compare /tmp/bits-main.npz /tmp/bits-R.npz 2>&1 > $OUT/bits.txt
head -1 $OUT/bits.txt >> $L; grep -c differs $OUT/bits.txt >> $L; grep differs $OUT/bits.txt | grep -v "_1_.*_d[kv] \|window_d[kv] " | head -5 >> $L
C=128:1024:1,128:4096:1,128:16384:1,128:4096:0,64:1024:1,64:4096:0,64:16384:0,64:16384:1
echo "== ab bwd deterministic" >> $L
timeout 120 python /tmp/ab.py --pass bwd --rounds 3 --options '{"deterministic": true}' --cells $C \
  $S/main $S/R 2>&1 | tee -a $OUT/ab.txt | tail -10 >> $L
echo "== GPU tests of R: deterministic, hd64 options" >> $L
gpu_tests R tests 200 tests/test_gpu.py tests/test_gpu_variants.py -k deterministic
cat $L
