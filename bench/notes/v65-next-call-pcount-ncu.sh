#!/bin/bash
# A device call (v65; about 3 min warm): why pcount (the persistent backward, tiles from the counter)
# loses 1.6-2.2% at hd128 4k/16k and hd64 16k causal (its step 5 instructions longer of 545, which
# alone would cost under 1%): ncu of main's and pcount's kernel in those cells, cycles (SMs' min,
# mean, max: the tail), instructions, DRAM bytes, L2 hit rate, tensor pipe, stall reasons.
# Trees: .device_scratch4 (as v65-next-call-persistent-backward-variants.sh).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch4 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
M=sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,gpc__cycles_elapsed.max,smsp__inst_executed.sum,\
dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,\
smsp__cycles_active.avg,sm__warps_active.avg.pct_of_peak_sustained_active
for tree in main pcount; do
  PYTHONPATH=$S/$tree timeout 120 ncu --profile-from-start off --clock-control base -k regex:"cupyflash_bwd_bfloat16_wgmma" \
    --metrics "$M,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python bench/attn_profile.py --impl cupyflash bwd:128:4096 bwd:64:16384:causal bwd:128:1024 > $OUT/ncu_$tree.txt 2>&1
  echo "$tree rc $? ($(date +%T))" >> $L
done
