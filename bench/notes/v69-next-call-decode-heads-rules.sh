#!/bin/bash
# A device call (v69; about 9 min): HEAD's KV GPU tests and memcheck, then five variants against HEAD,
# 18 cells, 3 rounds.
#   one: one kv head a tile everywhere (v68's rule off): the control for the cells v68 did not time,
#     such as batch 1 in 256-row pages (8 CTAs -> 2; dense 1 x 128k lost 2% with heads).
#   small: several kv heads a tile on long caches in 16-row pages too (past SHORT_CACHE, the small
#     pages' tile; v68's first call read 16 x 16k paged16 -3.3% and 1 x 128k -0.4 to -1.3% with them,
#     but on the runtime-shift kernel, which also cost one-head short cells 1.5-3.7%).
#   keep: the one-head table ('decode') kept where several heads cut the CTAs to the SMs or fewer
#     (HEAD chooses again: 64 x 128k hd64 then runs decode_few).
#   udiv: the page index by an unsigned division (hd64's 4-warp paged step 322 -> 315 instructions,
#     the dense path unchanged; a multiply-and-shift made ptxas predicate the paged block into the
#     dense step instead, +12 there).
#   s3: hd64's small pages' tile on three stages (v67's two CTAs an SM on long paged caches halved
#     the blocks in flight an SM; 90 registers, spill-free).
# Prediction: small within +-1.5% on long paged16 (the run's gain against fewer CTAs on 4-warp tiles);
# keep within 1% (decode_few's 32-key blocks and 3 stages against decode's 16 and 4); udiv +0-1.5% on
# paged16, dense within noise; s3 +1-4% on long hd64 paged16, the short cells it also serves
# (128 x 1k dense, 64 x 4k paged16) within 1%; one: batch-1 paged256 cells within 1% of main.
# Trees: device_trees.py .device_scratch10 main=HEAD small=HEAD+bench/notes/v69-decode-heads-small-pages.patch
#   keep=HEAD+bench/notes/v69-decode-heads-keep-table.patch udiv=HEAD+bench/notes/v69-decode-unsigned-page-division.patch
#   s3=HEAD+bench/notes/v69-decode-small-tile-three-stages.patch one=HEAD+bench/notes/v69-decode-heads-off.patch
#   --kernels kvcache; carry .device_scratch10.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch10 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests main kvcache_tests 170 tests/test_kvcache_gpu.py tests/test_torch_kvcache.py
(cd $S/main && PYTHONPATH=. timeout 80 compute-sanitizer --tool memcheck python tests/sanitize_run.py --kvcache-only > $OUT/memcheck.log 2>&1)
echo "memcheck rc $? ($(date +%T))" >> $L; tail -2 $OUT/memcheck.log >> $L
C=1:131072:32:8:64:paged16,16:16384:32:8:64:paged16,4:65536:32:8:64:paged16,16:131072:32:8:64:paged16
C=$C,64:16384:32:8:64:paged16,8:131072:32:8:128:paged16,16:16384:32:8:128:paged16,16:8192:32:32:64:paged16
C=$C,64:131072:32:8:64:dense,128:8192:32:8:64:dense,32:16384:32:8:64:dense,16:131072:32:32:64:dense
C=$C,64:65536:32:8:128:dense,128:1024:32:8:64:dense,64:4096:32:8:64:paged16
C=$C,1:131072:32:8:64:paged256,1:16384:32:8:64:paged256,1:65536:32:32:128:paged256
timeout 290 python /tmp/ab.py --pass decode --rounds 3 --cells $C $S/main $S/small $S/keep $S/udiv $S/s3 $S/one \
  2>&1 | tee $OUT/ab.txt | tail -21 >> $L
