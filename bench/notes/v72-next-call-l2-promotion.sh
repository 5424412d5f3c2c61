#!/bin/bash
# A device call (v72; about 4 min): the TMA maps' L2 promotion. v71's ncu read our hd128 16k forward
# moving 36% more L2 traffic than FA4's with the same K/V bytes; our maps ask the L2 to promote a
# miss to 128 bytes (cupyflash/_tma.py), CuTe's maps (FA4's) default to no promotion, and most hand-
# written Hopper GEMMs ask for 256. Only the maps change (the kernels are the same).
#   none: `v72-tma-l2-promotion-none.patch`;   256: `v72-tma-l2-promotion-256.patch`.
# Prediction: none within 1% (TMA asks for whole 128-byte rows, so the promotion changes nothing it
# fetches) unless the promotion is what the extra L2 traffic is; then none gains 1-5% at hd128 and
# reads less L2 traffic in ncu; 256 within 1%.
# Trees: device_trees.py .device_scratch17 main=HEAD none=HEAD+bench/notes/v72-tma-l2-promotion-none.patch
#   b256=HEAD+bench/notes/v72-tma-l2-promotion-256.patch --kernels ab; carry .device_scratch17.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch17 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=128:4096:0,128:16384:0,128:16384:1,128:1024:1,64:16384:0,256:16384:0
for pass in fwd bwd; do
  timeout 150 python /tmp/ab.py --pass $pass --rounds 5 --cells $C $S/main $S/none $S/b256 $S/main \
    2>&1 | tee -a $OUT/ab.txt | tail -8 >> $L
done
for tree in main none; do
  (cd $S/$tree && PYTHONPATH=. timeout 60 ncu -k regex:cupyflash_fwd_bfloat16 --launch-skip 5 --launch-count 1 \
    --metrics lts__t_sectors.sum,lts__t_requests.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_op_read.sum,sm__cycles_elapsed.max \
    --section SpeedOfLight python $OLDPWD/bench/power.py --worker cupyflash:fwd:128:0 16384 --short > $OUT/ncu-$tree.txt 2>&1)
  echo "ncu $tree rc $?" >> $L; grep -E "^ +(lts|sm)__|L2 Cache Throughput|Duration" $OUT/ncu-$tree.txt >> $L
done
cat $L
