#!/bin/bash
# Call 2 of 2 (about 4 min), right after `v51-next-call-fa4-a.sh` (carry [".device/fa4/a"]); carry
# [".device/fa4/b", ".device_scratch14"]. v71's power call: at hd128 16k (non-causal) ncu read our
# forward's L2 throughput at 45% of peak against FA4's 33% (L2 hit rate 99.75% against 94.5%, DRAM
# bytes within 6%), L2 compression input sectors 3.3M against 2.1M. Both read the same K and V
# bytes by TMA (FA4: no multicast), so what are our extra L2 requests? One launch each, ncu's L2
# and L1 traffic by operation, the instructions by kind, the warps' stall reasons. `IMPLS=cupyflash bash ...` (one call, carry
# [".device_scratch14"]) reads ours alone.
cd "$(dirname "$0")/../.."
IMPLS=${IMPLS:-cupyflash fa4}
[[ $IMPLS == *fa4* ]] && { source .device/fa4/b/install.sh finish .device/fa4/b || exit 1; }
mkdir -p /tmp/pcache && tar -xJf .device_scratch14/cache.tar.xz -C /tmp/pcache --strip-components=1
export CUPYFLASH_CACHE_DIR=/tmp/pcache PYTHONPATH=$PWD:$PYTHONPATH
M=lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_atom.sum,lts__t_sectors_op_red.sum
M=$M,lts__t_requests_op_read.sum,lts__t_requests_op_write.sum,lts__t_sector_hit_rate.pct,lts__t_sectors.sum
M=$M,lts__t_sectors_srcunit_tex.sum,lts__t_requests_srcunit_tex.sum,lts__t_tag_requests.sum
M=$M,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum
M=$M,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum
M=$M,smsp__inst_executed.sum,smsp__inst_executed_op_global_ld.sum,smsp__inst_executed_op_global_st.sum
M=$M,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,sm__cycles_elapsed.max
M=$M,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum
# (names less sure: in a run of their own, so that a wrong one loses only them)
M2=l1tex__m_xbar2l1tex_read_sectors.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__ltcfabric2lts_cycles_active.avg.pct_of_peak_sustained_elapsed
# Where the warps wait: ours issues ~3% fewer instructions than FA4 for ~6% more cycles (v71's
# cycles per issued instruction 6.29 against 5.78), so the stall reasons and their top SASS lines.
M3=regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio
for impl in $IMPLS; do
  K=$(python -c "import sys; sys.path.insert(0, 'bench'); import power; print(power.NCU_KERNELS['$impl'])")
  for m in "$M --section MemoryWorkloadAnalysis_Tables" "$M2" "$M3 --section SourceCounters"; do
    timeout 100 ncu -k $K --launch-skip 5 --launch-count 1 --metrics $m \
      python bench/power.py --worker $impl:fwd:128:0 16384 --short >> $OUT/ncu-l2-$impl.txt 2>&1
    echo "ncu $impl rc $?"
  done
  grep -E "^ +(lts|l1tex|smsp|sm)__|ERR" $OUT/ncu-l2-$impl.txt
  # Cycles at base clock and at whatever clock the GPU runs one launch unlocked: a kernel bound by
  # the SM clock takes the same cycles at both; one that waits on the L2 or DRAM takes more cycles
  # at the higher clock (v71: FA4 gains 7-10% from the grid's bursts over steady state, ours 2-6%).
  for clocks in base none; do
    timeout 60 ncu -k $K --launch-skip 5 --launch-count 3 --clock-control $clocks \
      --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,sm__cycles_elapsed.avg.per_second \
      python bench/power.py --worker $impl:fwd:128:0 16384 --short > $OUT/ncu-clock-$clocks-$impl.txt 2>&1
    echo "ncu $impl clocks $clocks rc $?"; grep -E "^ +(gpu|sm)__" $OUT/ncu-clock-$clocks-$impl.txt
  done
done
