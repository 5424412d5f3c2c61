#!/bin/bash
# Next call 2b (v48; short, for a spare call): v46's half-P-V forward's LOCAL tests (its A/B is in
# call 2), then why the options table's varlen row reads 1.16-1.21x the plain forward: the same
# equal-length call with and without no_host_sync (its cu_seqlens check reads them on the host each
# call) beside the plain one. About 200 s.
cd "$(dirname "$0")/.."
source bench/device_call.sh
echo "== half: LOCAL forward tests ($(date +%T))" > $L
cd $S/half
PYTHONPATH=. timeout 130 python -m pytest -m gpu -p no:cacheprovider -n 12 -q -p no:warnings tests/test_gpu.py tests/test_head_dims.py \
  -k "causal or local or window or tile_table or forward" > $OUT/tests_half.log 2>&1
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_half.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_half.log | head -10 >> $L
echo "== varlen (equal lengths) against plain, hd128 bf16, ms per call ($(date +%T))" >> $L
cd $S/main
PYTHONPATH=. timeout 60 python - >> $L 2>&1 <<'PY'
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
echo "done ($(date +%T))" >> $L
