#!/bin/bash
# A device call (v79, about 1 min; carry [".device_scratch29"], or rebuild it: device_trees.py
# .device_scratch29 head=HEAD --kernels ab --options '{"softcap": 30.0}' --options
# '{"alibi_slopes": "random"}' --options '{"dropout_p": 0.1, "seed": 1}' --options '{"deterministic": true}'):
# the options table's rows with a bound, each row's ratio over the plain kernels timed in its turns.
# Prediction: the plain row's ratio within 0.02 of 1.00; the backward rows' ratios 5-10% below v79's
# first run (1.32 -> ~1.2 deterministic at 4k), the forward rows' within 0.03 of it.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch29 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
timeout 150 python -m cupyflash bench --options-only --option-rows softcap alibi dropout deterministic \
  --out $OUT/options > $OUT/options.log 2>&1
echo "options rc $? ($(date +%T))" >> $L
cat $OUT/options/options.md >> $L
cat $L
