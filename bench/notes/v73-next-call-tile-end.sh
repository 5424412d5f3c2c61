#!/bin/bash
# A device call (v73; about 8 min; HEAD's tests come first): ways to shorten the forward's exposed tile end.
# v72's quad chunks (HEAD) cut a lane's unstaged O stores four-fold and gained hd256 1k +15-17%:
# where a tile has one Q buffer (hd128 non-causal on three stages, every hd256 tile, hd64's three
# consumers), its end is exposed.
#   lines: a warp's O store still touches 8 lines (8 rows x 64 bytes); pairing quad chunks across
#     lanes ^ 16 (for_each_line_chunk, 4 more SHFL per 64 columns) makes it 4 rows x 128 bytes,
#     4 whole lines, with the same instruction count (v73-fwd-o-line-chunks.patch).
#   carry: tiles back to back (kCarry: a tile's last P V beside the next tile's first Q K^T, its O
#     stored after) with one Q buffer too, the next Q loaded once the last Q K^T has read the buffer
#     (v73-fwd-carry-one-q-buffer.patch; v27 measured it only with two Q buffers and two stages).
#   both: the two patches.
#   prefetch: the producer puts the next round's Q into the L2 (cp.async.bulk.prefetch.tensor) as it
#     starts a tile, in kernels of one Q buffer and no tile counter (v73-fwd-next-q-prefetch.patch):
#     their Q is copied only after the tile's last Q K^T, then waited for; carry_prefetch: both.
#   carry_words: carry, with the carried tiles' O as the fragments' words (v73-fwd-carried-tiles-words.patch):
#     a carried tile's O leaves inside the next tile's first block, between its softmax and its P V,
#     where the quad chunks' shuffles add latency and the words' stores do not wait (hd64's two
#     consumers, whose tiles are carried, lost 2.4% with the chunks).
# Prediction: lines, if the store costs a cycle a line: hd256 1k +3-6% over HEAD, 16k +0.5-1%; if
# it costs an issue slot an instruction, within noise. carry: +2-5% at hd256 1k and 4k and hd128 4k
# where the next Q lands within a block's time; within noise at 16k; a loss where the first Q K^T
# then waits on Q with the last P V's accumulators held; prefetch makes that wait shorter
# (carry_prefetch >= carry) and alone gains at most 1% (HEAD's tile end already covers the load).
# Against carry: it nearly doubles the kernels' code (hd256 3672 -> 6792 instructions, the
# carried first block and finish_tile inlined a second time): instruction-cache misses can eat it.
# Unchanged kernels, the controls: hd128 1k (the short table: two Q buffers, staged O, carried) and
# hd128 4k causal (LOCAL, the same). hd64 4k/16k (three consumers, staged O) see carry and prefetch.
# First HEAD's forward tests: v72 landed its quad chunks in a leaner form than the patch whose
# tests passed (421 of 439), not yet run itself.
# Trees: device_trees.py .device_scratch20 main=HEAD lines=HEAD+bench/notes/v73-fwd-o-line-chunks.patch
#   carry=HEAD+bench/notes/v73-fwd-carry-one-q-buffer.patch
#   both=HEAD+bench/notes/v73-fwd-o-line-chunks.patch+bench/notes/v73-fwd-carry-one-q-buffer.patch
#   carry_words=HEAD+bench/notes/v73-fwd-carry-one-q-buffer.patch+bench/notes/v73-fwd-carried-tiles-words.patch
#   prefetch=HEAD+bench/notes/v73-fwd-next-q-prefetch.patch
#   carry_prefetch=HEAD+bench/notes/v73-fwd-carry-one-q-buffer.patch+bench/notes/v73-fwd-next-q-prefetch.patch
#   --kernels ab --dtypes bfloat16 float16; and HEAD's every kernel in .device_scratch14 (device_trees.py
#   .device_scratch14 main=HEAD --kernels all --named bench/device-test-kernels.txt) for its tests;
#   carry [".device_scratch20", ".device_scratch14"].
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch20 source bench/device_call.sh
tar -xJf .device_scratch14/cache.tar.xz -C /tmp/pcache --strip-components=1
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests main tests_main 230 tests/test_gpu.py tests/test_head_dims.py tests/test_gpu_variants.py
for dtype in bfloat16 float16; do
  cells=128:1024:0,128:4096:0,128:16384:0,256:1024:0,256:4096:0,256:16384:0,256:4096:1,64:4096:0,64:16384:0,64:4096:1,128:4096:1
  [ $dtype = float16 ] && cells=128:16384:0,256:1024:0,256:16384:0,64:16384:0
  echo "== ab fwd $dtype" >> $L
  timeout $([ $dtype = float16 ] && echo 70 || echo 160) python /tmp/ab.py --pass fwd --dtype $dtype --rounds 7 \
    --cells $cells $S/main $S/lines $S/carry $S/both $S/carry_words $S/prefetch $S/carry_prefetch $S/main \
    2>&1 | tee -a $OUT/ab.txt | tail -13 >> $L
done
cat $L
