#!/bin/bash
# A device call (v78; about 7 min; carry [".device_scratch25"]): the deterministic backward's turns.
# Its dQ adder held each step's turn, and the consumers' dQ buffer, until the step's reductions were
# complete and the turn released; in the LOCAL kernels every key block walks its query blocks up
# from the first it sees, so the later key blocks reach a query block first and wait for the
# earlier ones (a causal CTA takes as long as the heaviest of its pair group).
# Trees (device_trees.py .device_scratch25 ... --kernels ab --options '{"deterministic": true}'):
#   main = HEAD; E = v78-det-adder-early-empty.patch (dQ's buffer back after the reads, the turn
#   released after the adds complete); P = v78-det-adder-release-next-step.patch (that, and the turn
#   released at the next step's dQ, so the completion waits off the adder's path); PR =
#   v78-det-release-next-step-local-down.patch (P, and the LOCAL deterministic kernels walk their
#   query blocks down, so that a pair's key blocks reach each query block together).
# Prediction: E and P the same bits as main (the same adds in the same order), PR too but for the
# LOCAL deterministic dk and dv (their steps' order); non-causal deterministic +5-20% (P > E), causal
# 1k +15-30% (PR), 16k causal within a few %.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch25 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
echo "== same bits (main, P, PR)" >> $L
for tree in main P PR; do
  (cd $S/$tree && PYTHONPATH=. timeout 120 python $OLDPWD/bench/notes/v74-same-bits.py write /tmp/bits-$tree.npz) >> $L 2>&1
done
for tree in P PR; do
  python bench/notes/v74-same-bits.py compare /tmp/bits-main.npz /tmp/bits-$tree.npz 2>&1 | head -6 >> $L
done
C=128:1024:0,128:1024:1,128:4096:0,128:4096:1,128:16384:0,128:16384:1,64:1024:1,64:4096:0,64:16384:0,64:16384:1
echo "== ab bwd deterministic" >> $L
timeout 200 python /tmp/ab.py --pass bwd --rounds 3 --options '{"deterministic": true}' --cells $C \
  $S/main $S/E $S/P $S/PR 2>&1 | tee -a $OUT/ab.txt | tail -12 >> $L
echo "== ab bwd plain (main)" >> $L
timeout 60 python /tmp/ab.py --pass bwd --rounds 3 --cells $C $S/main 2>&1 | tee -a $OUT/ab.txt | tail -12 >> $L
echo "== deterministic GPU tests of PR" >> $L
gpu_tests PR tests 200 tests/test_gpu.py tests/test_gpu_variants.py -k deterministic
cat $L
