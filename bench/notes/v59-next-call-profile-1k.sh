#!/bin/bash
# A device call (v59; about 180 s warm; right after v51-next-call-fa4-b.sh, whose FA4 install in
# /tmp/fa4site it then profiles too): ncu of the 1k cells where cuDNN leads the forward most (hd64
# causal 0.83, hd128 causal 0.88, hd64 0.90 in v45's grid) beside a cell where we lead (hd64 4k),
# the hd64 1k causal backward (0.86 of FA4's) and the 80-row hd128 4k backward (0.89, about 0.94
# since v49): ours, cuDNN's and FA4's kernels, one call each (bench/attn_profile.py). The question:
# at 1k, is a CTA short of tensor-pipe work because of its L2 traffic (hd64's 128-row tile reads
# 32 KB of K and V per 4.2 MFLOP step), its tile starts and ends, or its instruction stream?
# Run from the repository root: bash bench/notes/v59-next-call-profile-1k.sh
cd "$(dirname "$0")/../.."
L=$OUT/log.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L
if [ -f .device_scratch/cache.tar.xz ]; then
  mkdir -p /tmp/pcache && tar -xJf .device_scratch/cache.tar.xz -C /tmp/pcache --strip-components=1
  export CUPYFLASH_CACHE_DIR=/tmp/pcache
fi
IMPLS=(--impl cupyflash --impl "SDPA cuDNN")
if [ -d /tmp/fa4site ]; then
  export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  IMPLS+=(--impl "FA4 (flash-attn-4)")
fi
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
  --section InstructionStats"
PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout 400 ncu --profile-from-start off --clock-control none $SECTIONS \
  --metrics lts__t_bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
  python bench/attn_profile.py "${IMPLS[@]}" fwd:64:1024:causal fwd:128:1024:causal fwd:64:1024 fwd:64:4096 bwd:64:1024:causal bwd:128:4096 \
  > $OUT/ncu.txt 2>&1
echo "ncu rc $? ($(date +%T))" >> $L
grep -E "^  [a-zA-Z_]|profiled:|Duration|Throughput|Pipe|Issue|Warp Cycles|Bytes|lts__|dram__|tensor" $OUT/ncu.txt | head -150 >> $L
