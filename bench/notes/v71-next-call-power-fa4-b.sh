#!/bin/bash
# Call 2 of 2 (about 4-6 min), right after `v51-next-call-fa4-a.sh` (carry [".device/fa4/a"]); carry
# [".device/fa4/b", ".device_scratch14"]. v70's question: on the H100 FA4's hd128 forward runs 719
# TFLOP/s at 16k (H200: ~690) while ours holds 650 on both GPUs. If FA4 gains where the H100's power
# cap leaves the SMs more clock and ours does not, ours waits on something that does not scale with
# the SM clock (memory, L2 latency, barriers). bench/power.py reads each run's clock and board power
# in its steady state: ours, FA4 and cuDNN, hd128 forward (16k and 4k, causal and not) and backward
# (16k), then ours and FA4's DRAM bytes (ncu) at 16k. Our kernels: .device_scratch14 (if missing:
# device_trees.py .device_scratch14 main=HEAD --kernels all --named bench/device-test-kernels.txt).
cd "$(dirname "$0")/../.."
source .device/fa4/b/install.sh finish .device/fa4/b || exit 1
mkdir -p /tmp/pcache && tar -xJf .device_scratch14/cache.tar.xz -C /tmp/pcache --strip-components=1
export CUPYFLASH_CACHE_DIR=/tmp/pcache PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/power.txt
for seqlen in 16384 4096; do
  timeout 200 python bench/power.py --seqlen $seqlen cupyflash:fwd:128:0 fa4:fwd:128:0 cudnn:fwd:128:0 \
    cupyflash:fwd:128:1 fa4:fwd:128:1 cudnn:fwd:128:1 2>&1 | tee -a $OUT/power.txt
done
timeout 90 python bench/power.py --seqlen 16384 cupyflash:bwd:128:0 fa4:bwd:128:0 2>&1 | tee -a $OUT/power.txt
timeout 120 python bench/power.py --dram --seqlen 16384 cupyflash:fwd:128:0 fa4:fwd:128:0 2>&1 | tee -a $OUT/power.txt
# The L2's share and the warps' stalls at hd128 16k: a 128 x 128 block step loads 64 KB of K and V
# for 8.4 MFLOP, ~5.5 TB/s out of the L2 at 700 TFLOP/s, near what the H100's L2 is said to give; and
# a ring of 3 stages covers a fixed time in microseconds, less of it as the clock rises. ncu's
# speed-of-light, memory and warp-state sections of one launch each (ncu fixes the clocks at base:
# read ratios, not speeds).
for impl in cupyflash fa4; do
  timeout 90 ncu -k $(python -c "import sys; sys.path.insert(0, 'bench'); import power; print(power.NCU_KERNELS['$impl'])") \
    --launch-skip 5 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    python bench/power.py --worker $impl:fwd:128:0 16384 --short > $OUT/ncu-$impl.txt 2>&1
  echo "ncu $impl rc $?"; grep -E "L2 Hit|L2 Cache Throughput|Memory Throughput|DRAM Throughput|Duration|SM Frequency|Stall|Warp Cycles" $OUT/ncu-$impl.txt
done
