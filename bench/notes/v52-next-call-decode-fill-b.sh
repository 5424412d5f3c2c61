#!/bin/bash
# A device call (v52, b of two; about 420 s warm, no trees or kernel cache needed): the split count
# over whole waves (v52-decode-splits-over-whole-waves.patch) against HEAD on odd batches, fewer
# splits in clusters (v52-decode-fewer-splits-in-clusters.patch) on small cells, and ncu
# of long-cache steps beside cuDNN's (bench/notes/v52).
# Run from the repository root: bash bench/notes/v52-next-call-decode-fill-b.sh
cd "$(dirname "$0")/../.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/log.txt
: > $L
# 3. The two patches: v52-decode-splits-over-whole-waves.patch (the split count modelled where one
# CTA streams per SM and whole waves of long streams sit partly idle) and
# v52-decode-fewer-splits-in-clusters.patch (short steps whose clusters of splits would not fit one
# wave take fewer splits whose clusters do). First their GPU tests, both applied (the KV-cache files).
P=$PWD/bench/notes
for t in ww wc wb; do rm -rf /tmp/$t && mkdir -p /tmp/$t && cp -r cupyflash cuda_src tests bench setup.cfg pyproject.toml /tmp/$t/; done
(cd /tmp/ww && git apply $P/v52-decode-splits-over-whole-waves.patch) >> $L 2>&1
(cd /tmp/wc && git apply $P/v52-decode-fewer-splits-in-clusters.patch) >> $L 2>&1
(cd /tmp/wb && git apply $P/v52-decode-splits-over-whole-waves.patch && git apply $P/v52-decode-fewer-splits-in-clusters.patch) >> $L 2>&1
echo "== both patches: KV-cache GPU tests ($(date +%T))" >> $L
(cd /tmp/wb && PYTHONPATH=. timeout 150 python -m pytest -m gpu -p no:cacheprovider -n 12 -q -p no:warnings \
  tests/test_kvcache_gpu.py tests/test_torch_kvcache.py tests/test_kvcache.py > $OUT/tests_wb.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_wb.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_wb.log | head -10 >> $L
# Odd batches against HEAD in turns, then the forced counts around the rule's picks. The last
# three cells are controls the rule leaves alone.
echo "== ab decode: HEAD against the whole-waves rule ($(date +%T))" >> $L
C=17:65536:32:8:128:dense,13:65536:32:8:128:dense,3:65536:32:32:128:dense,5:65536:32:32:128:dense,9:65536:32:8:128:dense,6:16384:32:8:128:dense,35:65536:8:1:128:dense,17:131072:8:1:128:paged256,15:65536:32:8:64:dense,16:65536:32:8:128:dense
timeout 120 python bench/ab.py --pass decode --rounds 5 --cells $C . /tmp/ww >> $L 2>&1
echo "== decode_splits in the whole-waves tree ($(date +%T))" >> $L
(cd /tmp/ww/bench && PYTHONPATH=.. timeout 120 python decode_splits.py --counts 1 2 3 4 5 6 8 9 11 16 33 --cells ${C//,/ }) >> $L 2>&1
echo "rc $? ($(date +%T))" >> $L
# 3b. Fewer splits in clusters on small cells, against HEAD in turns (the last cell a control).
echo "== ab decode: HEAD against fewer splits in clusters ($(date +%T))" >> $L
C=16:1024:8:1:128:dense,4:1024:32:8:128:dense,1:1024:32:32:128:dense,4:1024:32:8:64:dense,16:2048:8:1:128:dense,16:4096:8:1:128:dense,32:1024:8:1:128:dense,16:1024:8:1:128:paged16,4:1024:32:8:128:paged16,16:1024:8:1:64:dense
timeout 100 python bench/ab.py --pass decode --rounds 7 --cells $C . /tmp/wc >> $L 2>&1
# 4. ncu of one step of each implementation (bench/decode_profile.py): do our SMs idle before the
# step ends (sm__cycles_active avg against max), and at what DRAM rate do we and cuDNN read? The
# first five cells are long caches; the next three small steps (6-12 us) that trail cuDNN by a fixed
# 1-3 us (kernel times apart); the last the paged16 twin of the fourth (9.5% below it in v45).
echo "== ncu: decode steps beside cuDNN's ($(date +%T))" >> $L
M=$(python -c "import sys; sys.path.insert(0, 'bench'); import decode_profile; print(decode_profile.METRICS)")
PYTHONPATH=. timeout 150 ncu --profile-from-start off --clock-control none --csv --metrics $M \
  python bench/decode_profile.py 128:65536:8:1:128:dense 132:65536:8:1:128:dense 16:65536:32:32:128:dense \
  128:65536:32:8:64:dense 16:131072:32:32:64:dense 1:1024:8:1:64:dense 4:4096:8:1:128:dense \
  1:16384:8:1:128:dense 128:65536:32:8:64:paged16 > $OUT/ncu.csv 2> $OUT/ncu.err
echo "rc $? ($(date +%T))" >> $L; grep -c '"' $OUT/ncu.csv >> $L; tail -3 $OUT/ncu.err >> $L
