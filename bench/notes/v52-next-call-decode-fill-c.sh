#!/bin/bash
# A device call (v52, c; about 200 s warm, no trees or kernel cache needed):
# v52-decode-equal-long-splits.patch, the decode kernel's long splits as equal shares of blocks
# (whole rounds of a block per warp only under 8 rounds), so that 4 query blocks take 33 splits
# (132 CTAs: every SM of the H200) where they took 32. Its GPU tests, memcheck of the KV-cache
# cases, then the 20 grid cells whose counts it changes, against HEAD in turns (bench/notes/v52).
# Run from the repository root: bash bench/notes/v52-next-call-decode-fill-c.sh
cd "$(dirname "$0")/../.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/log.txt
: > $L
P=$PWD/bench/notes
rm -rf /tmp/we && mkdir -p /tmp/we && cp -r cupyflash cuda_src tests bench setup.cfg pyproject.toml /tmp/we/
(cd /tmp/we && git apply $P/v52-decode-equal-long-splits.patch) >> $L 2>&1
echo "== equal long splits: KV-cache GPU tests ($(date +%T))" >> $L
(cd /tmp/we && PYTHONPATH=. timeout 150 python -m pytest -m gpu -p no:cacheprovider -n 12 -q -p no:warnings \
  tests/test_kvcache_gpu.py tests/test_torch_kvcache.py tests/test_kvcache.py > $OUT/tests_we.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_we.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_we.log | head -10 >> $L
(cd /tmp/we && PYTHONPATH=. timeout 60 compute-sanitizer --tool memcheck python tests/sanitize_run.py --kvcache-only 2>&1 | tail -2) >> $L
echo "== ab decode: HEAD against equal long splits ($(date +%T))" >> $L
C=1:65536:32:8:64:paged16,1:65536:32:8:64:paged256,1:131072:32:8:64:paged256,1:131072:8:1:128:paged16,4:65536:8:1:128:dense,4:65536:8:1:128:paged16,4:65536:8:1:128:paged256,4:131072:8:1:64:dense,4:131072:8:1:64:paged256,4:131072:8:1:128:dense,4:131072:8:1:128:paged256,16:65536:32:8:128:dense
timeout 120 python bench/ab.py --pass decode --rounds 7 --cells $C . /tmp/we >> $L 2>&1
echo "done ($(date +%T))" >> $L
