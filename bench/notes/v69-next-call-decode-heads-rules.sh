#!/bin/bash
# A device call (v69; about 6 min): two variants of v68's rule for several kv heads a decode tile, and
# the page index by an unsigned division (`udiv`: paged step 322 -> 315 instructions at hd64's 4-warp
# tile, the dense path unchanged; a multiply-and-shift instead made ptxas predicate the paged block
# into the dense step, +12 there), against HEAD: `small` takes them on long caches in small pages too (16-row pages past SHORT_CACHE,
# the small pages' tile; v68's first call read 16 x 16k paged16 -3.3% and 1 x 128k -0.4 to -1.3% with
# them, but on the runtime-shift kernel that also cost one-head short cells 1.5-3.7%), `keep` keeps
# the one-head table ('decode') where several heads cut the CTAs to the SMs or fewer (HEAD chooses
# again: 64 x 128k hd64 then runs decode_few). 13 cells, 3 rounds, trees alternated twice.
# Prediction: small: paged16 long cells within +-1.5% (the pattern gain against fewer CTAs on 4-warp
# tiles); keep: within 1% (decode_few's 32-key blocks and 3 stages against decode's 16 and 4);
# udiv: paged16 +0-1.5% (2% fewer instructions a step), dense within noise.
# Trees: device_trees.py .device_scratch10 main=HEAD small=HEAD+bench/notes/v69-decode-heads-small-pages.patch
#   keep=HEAD+bench/notes/v69-decode-heads-keep-table.patch udiv=HEAD+bench/notes/v69-decode-unsigned-page-division.patch
#   --kernels kvcache; carry .device_scratch10.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch10 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=1:131072:32:8:64:paged16,16:16384:32:8:64:paged16,4:65536:32:8:64:paged16,16:131072:32:8:64:paged16
C=$C,64:16384:32:8:64:paged16,8:131072:32:8:128:paged16,16:16384:32:8:128:paged16,16:8192:32:32:64:paged16
C=$C,64:131072:32:8:64:dense,128:8192:32:8:64:dense,32:16384:32:8:64:dense,16:131072:32:32:64:dense
C=$C,64:65536:32:8:128:dense
timeout 480 python /tmp/ab.py --pass decode --rounds 3 --cells $C $S/main $S/small $S/keep $S/udiv $S/main $S/small $S/keep $S/udiv \
  2>&1 | tee $OUT/ab.txt | tail -16 >> $L
