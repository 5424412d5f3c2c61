#!/bin/bash
# A device call (v60; about 120 s warm): where the hd64 1k forwards and the causal backward stall, ours beside cuDNN's (v60's
# H100 profile: causal 434k cycles against cuDNN's 363k, tensor pipe 34% against 41%, the same
# instruction count within 5%). Per kernel the stall reasons per issued instruction; for ours, the
# SASS page of stall samples (SourceCounters), to find the instructions the warps wait at.
# Run from the repository root: bash bench/notes/v60-next-call-stalls-1k.sh (carry .device_scratch for the kernel cache).
cd "$(dirname "$0")/../.."
source bench/device_call.sh
L=$OUT/stalls_log.txt  # (beside the log of the call before it on the same machine)
nvidia-smi --query-gpu=name --format=csv,noheader > $L
CELLS="fwd:64:1024:causal fwd:64:1024 bwd:64:1024:causal"
PYTHONPATH=. timeout 200 ncu --profile-from-start off --clock-control none -k regex:"cupyflash_(fwd|bwd)_bfloat16_wgmma|cudnn_generated" \
  --section WarpStateStats --metrics regex:"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  python bench/attn_profile.py --impl cupyflash --impl "SDPA cuDNN" $CELLS > $OUT/stalls.txt 2>&1
echo "stalls rc $? ($(date +%T))" >> $L
PYTHONPATH=. timeout 200 ncu --profile-from-start off --clock-control none -k regex:"cupyflash_(fwd|bwd)_bfloat16_wgmma" \
  --section SourceCounters --section WarpStateStats --import-source no -f -o /tmp/ours \
  python bench/attn_profile.py --impl cupyflash $CELLS > $OUT/source_run.txt 2>&1
echo "source rc $? ($(date +%T))" >> $L
timeout 60 ncu -i /tmp/ours.ncu-rep --page source --csv --print-source sass > $OUT/ours_sass.csv 2> $OUT/ours_sass.err
echo "sass page rc $? ($(date +%T)); $(wc -l < $OUT/ours_sass.csv) lines" >> $L
