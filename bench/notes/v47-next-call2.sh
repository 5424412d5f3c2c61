#!/bin/bash
# v48 call 2 (prepared in v47): the forced mma.sync family's GPU files that v46 did not reach and
# its memcheck, on main (HEAD); then why the options table's varlen row reads 1.16-1.21x the plain
# forward: the same equal-length call timed with and without no_host_sync (its cu_seqlens check
# reads them on the host each call) beside the plain call. About 400 s.
cd "$(dirname "$0")/.."
mkdir -p /tmp/pcache && tar -xJf .device_scratch/cache.tar.xz -C /tmp/pcache --strip-components=1
export CUPYFLASH_CACHE_DIR=/tmp/pcache XLA_PYTHON_CLIENT_PREALLOCATE=false
touch /tmp/t0
S=$PWD/.device_scratch
L=$OUT/log.txt
echo "== main, forced mma_sync: the GPU files v46 did not reach ($(date +%T))" > $L
cd $S/main
CUPYFLASH_FAMILY=mma_sync PYTHONPATH=. timeout 200 python -m pytest -m gpu -n 12 -v -p no:cacheprovider -p no:warnings \
  $(ls tests/test_*.py | grep -v -e test_gpu.py -e test_head_dims.py -e test_gpu_variants.py -e test_bench_context_parallel.py) \
  > $OUT/forced_rest.log 2>&1
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/forced_rest.log >> $L; grep -E "FAILED|ERROR" $OUT/forced_rest.log | head -20 >> $L
echo "== main, forced mma_sync: memcheck ($(date +%T))" >> $L
CUPYFLASH_FAMILY=mma_sync PYTHONPATH=. timeout 80 compute-sanitizer --tool memcheck python tests/sanitize_run.py 2>&1 | tail -2 >> $L
echo "== varlen (equal lengths) against plain, hd128 bf16, ms per call ($(date +%T))" >> $L
PYTHONPATH=. timeout 90 python - >> $L 2>&1 <<'PY'
import torch, cupyflash
from cupyflash.benchmark import BatchTimer, median_ms
for batch, seqlen in ((4, 4096), (1, 16384)):
    q, k, v = (torch.randn(batch, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, device="cuda", dtype=torch.int32)
    packed = [x.reshape(batch * seqlen, 16, 128) for x in (q, k, v)]
    def quiet():
        with cupyflash.no_host_sync():
            return cupyflash.flash_attn_varlen_func(*packed, cu, cu, seqlen, seqlen)
    calls = {"plain": lambda: cupyflash.flash_attn_func(q, k, v),
             "varlen": lambda: cupyflash.flash_attn_varlen_func(*packed, cu, cu, seqlen, seqlen),
             "varlen, no_host_sync": quiet}
    times = median_ms({name: BatchTimer(fn) for name, fn in calls.items()}, reps=7)
    print(batch, seqlen, {name: round(ms, 3) for name, ms in times.items()})
PY
cd $S/..
find /tmp/pcache -newer /tmp/t0 -type f | tar -cJf $OUT/newcache.tar.xz -T - 2>/dev/null
echo "done ($(date +%T))" >> $L
