#!/bin/bash
# A device call (v80, about 5 min, 6 with the options table; carry [".device_scratch30",
# ".device_scratch29"] (the second for v79's options table at the end), or rebuild it: device_trees.py
# .device_scratch30 main=HEAD alibi=HEAD+bench/notes/v80-alibi-alone-on-the-plain-tiles.patch --kernels ab
# --options '{"alibi_slopes": "random"}'; the forced family's kernels compile on the device).
# ALiBi alone's backward on the plain tiles: the mma.sync kernels add it by rows ahead of the plain
# passes (before: the options' per-element pass on their 128 x 64 tile at hd128), the wgmma family's
# hd64 on 128 query rows (before: the options' 64). Every other backward's SASS is unchanged.
# Prediction: mma.sync ALiBi backward 1.28-1.30x plain (v79's table) -> 1.05-1.10x; wgmma hd64
# ALiBi backward +15-30%; wgmma hd128 and hd256 the same kernels as before (within noise).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch30 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
ab() { timeout "$1" python /tmp/ab.py --pass bwd --rounds 3 "${@:2}" 2>&1 | tee -a $OUT/ab.txt | tail -9 >> $L; }
C=64:4096:0,64:4096:1,64:16384:0,128:4096:0,128:16384:0,128:4096:1,256:4096:0
echo "== wgmma: ab bwd ALiBi, main and alibi; then plain (main)" >> $L
ab 120 --options '{"alibi_slopes": "random"}' --cells $C $S/main $S/alibi
ab 60 --cells $C $S/main
echo "== mma.sync (forced): ab bwd ALiBi, main and alibi; then plain (main)" >> $L
C=64:4096:0,128:4096:0,128:16384:0,128:4096:1,256:4096:0
CUPYFLASH_FAMILY=mma_sync ab 200 --options '{"alibi_slopes": "random"}' --cells $C $S/main $S/alibi
CUPYFLASH_FAMILY=mma_sync ab 90 --cells $C $S/main
echo "== GPU tests of alibi: ALiBi and the table choice, wgmma; then mma.sync (forced)" >> $L
gpu_tests alibi tests 150 tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k "alibi or full_and_the_edged"
CUPYFLASH_FAMILY=mma_sync gpu_tests alibi tests-mma-sync 150 tests/test_gpu.py tests/test_gpu_variants.py \
  tests/test_head_dims.py -k "alibi"
# Then v79-next-call-options.sh's table (HEAD), where .device_scratch29 came too (its kernels).
if [ -f .device_scratch29/cache.tar.xz ]; then
  tar -xJf .device_scratch29/cache.tar.xz -C /tmp/pcache --strip-components=1
  timeout 150 python -m cupyflash bench --options-only --option-rows softcap alibi dropout deterministic \
    --out $OUT/options > $OUT/options.log 2>&1
  echo "options rc $? ($(date +%T))" >> $L
  cat $OUT/options/options.md >> $L
fi
cat $L
