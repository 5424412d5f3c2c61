#!/bin/bash
# A device call (v74; about 4 min; carry [".device_scratch22"]): hd64's options on two consumers.
# Past 1k rows hd64 runs three consumers (192 x 128), and there its options' kernels are serial
# (sm90/fwd.cuh kSerial: 160 registers each, so each P V completes before the softmax; ptxas also
# reports their wgmmas serialised, C7520/C7515): softcap 1.52x the plain forward at hd64 16k against
# 1.26x at hd128 (v72). v74-hd64-options-on-two-consumers.patch gives hd64 calls with options the
# short table's tile (128 x 128, three stages, two consumers that overlap their products).
# Prediction: softcap, ALiBi and dropout +10-20% at hd64 4k-16k (their extra work overlapped with the
# other consumer's products, as at hd128), plain hd64 unchanged (the control).
# Trees: device_trees.py .device_scratch22 main=HEAD two=HEAD+bench/notes/v74-hd64-options-on-two-consumers.patch
#   --kernels ab --options '{"softcap": 30.0}' --options '{"alibi_slopes": "random"}'
#   --options '{"dropout_p": 0.1, "seed": 1}'
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch22 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=64:4096:0,64:16384:0,64:4096:1,64:16384:1
for options in '{}' '{"softcap": 30.0}' '{"alibi_slopes": "random"}' '{"dropout_p": 0.1, "seed": 1}'; do
  echo "== $options" >> $L
  timeout 55 python /tmp/ab.py --pass fwd --rounds 5 --options "$options" --cells $C $S/main $S/two $S/main $S/two \
    2>&1 | tee -a $OUT/ab.txt | tail -5 >> $L
done
cat $L
