#!/bin/bash
# A device call (v74; about 4 min; carry [".device_scratch21"]): the backward's dK runs on into the
# next step. At HEAD each consumer's step ends waiting for its dK += dS^T Q (wgmma_wait<0>) before
# the next step's S^T and dP^T are issued, so the tensor cores idle for that consumer between
# steps unless the other fills them. v74-bwd-dk-runs-into-the-next-step.patch (hd64/hd128, not
# hd256's shared-P path) drops that wait: dK completes by the next step's S^T wait, where the Q
# stage goes back to the producer. dK then reads dS^T from shared memory (SS, as dQ does), since
# ds_frag held across the loop made ptxas serialise every product (C7512, insufficient registers).
# Spill-free, no ptxas messages in the 13 bf16 sm_90a backward variants.
# Prediction: +1-4% at hd128 and hd64 (FA4 waits for dK at the step's end too: the other consumer's
# products cover one's tail unless both tails meet), 1k cells at the top; hd256 unchanged (the control).
# Trees (call a's): device_trees.py .device_scratch21 main=HEAD exps=HEAD+bench/notes/v74-fwd-exps-before-the-pv-wait.patch
#   dk=HEAD+bench/notes/v74-bwd-dk-runs-into-the-next-step.patch
#   both=HEAD+bench/notes/v74-fwd-exps-before-the-pv-wait.patch+bench/notes/v74-bwd-dk-runs-into-the-next-step.patch
#   --kernels all --named bench/device-test-kernels.txt --dtypes bfloat16 float16 (16 MB).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch21 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=128:1024:0,128:1024:1,128:4096:0,128:4096:1,128:16384:0,128:16384:1,64:4096:0,64:16384:0,64:16384:1,256:16384:0
echo "== ab bwd bfloat16" >> $L
timeout 150 python /tmp/ab.py --pass bwd --rounds 7 --cells $C $S/main $S/dk $S/main $S/dk 2>&1 | tee -a $OUT/ab.txt | tail -13 >> $L
echo "== ab bwd float16" >> $L
timeout 50 python /tmp/ab.py --pass bwd --dtype float16 --rounds 5 --cells 128:16384:0,128:16384:1,64:16384:0 \
  $S/main $S/dk $S/main $S/dk 2>&1 | tee -a $OUT/ab.txt | tail -6 >> $L
echo "== ab bwd deterministic" >> $L
timeout 40 python /tmp/ab.py --pass bwd --rounds 5 --options '{"deterministic": true}' --cells 128:16384:0,64:16384:1 \
  $S/main $S/dk $S/main $S/dk 2>&1 | tee -a $OUT/ab.txt | tail -5 >> $L
cat $L
