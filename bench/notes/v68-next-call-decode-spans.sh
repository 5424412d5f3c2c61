#!/bin/bash
# A device call (v68; under a minute): how many KV heads' rows must a decode CTA read together to
# stream as whole rows do? v67: one head's 128-byte rows a CTA 3.05-3.13 TB/s, every head's whole
# rows 3.16-3.20 (cuDNN's decode 3.20), a CTA whose warps each read one of 8 heads as per_head.
# `decode_stream.py --spans`: the decode's steps (8 warps, 16 rows a step in turn) with a row of
# 1, 2, 4, 8 (..., heads) heads' rows contiguous, hd64 and hd128, at one CTA an SM and at full
# occupancy. Prediction: hd64 span 1 ~3.08, whole rows ~3.17; if span 2 or 4 reads as whole rows, a
# warp can take 2-4 heads (no CTA barrier), else the design needs the CTA's warps loading together.
# hd128 (256-byte rows): smaller gap, if any. No trees: the working tree's bench/.
cd "$(dirname "$0")/../.."
L=$OUT/log.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L
timeout 120 python bench/decode_stream.py --spans >> $L 2>&1
echo "rc $? ($(date +%T))" >> $L
