#!/bin/bash
# Next call 2c (v48, a session without a device): the hd128 80-row backward's dQ^T leaving in its
# accumulators' order (dqf = HEAD + v48-bwd-dq-in-fragment-order.patch: 10 16-byte shared stores a
# step instead of 40 scalar ones and their addresses, dq_accum in that order per 80-row block,
# flash_bwd_convert_dq reading it back, flash_bwd_dot zeroing whole blocks; the consumer index
# warp-uniform there too: step loop 783 -> 545 instructions, FA4's 463). Its backward tests, racecheck
# and memcheck of the sanitizer cases (the 80-row backward among them), then an A/B of the backward
# beside main. About 360 s.
cd "$(dirname "$0")/.."
source bench/device_call.sh
echo "== dqf: backward tests ($(date +%T))" > $L
cd $S/dqf
PYTHONPATH=. timeout 140 python -m pytest -m gpu -p no:cacheprovider -n 12 -q -p no:warnings tests/test_gpu.py \
  tests/test_head_dims.py tests/test_torch_cuda.py -k "backward or full or forward_backward or every_tile_table or head_dim or options" \
  > $OUT/tests_dqf.log 2>&1
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_dqf.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_dqf.log | head -10 >> $L
echo "== dqf: racecheck, then memcheck, of 80-row backward cases ($(date +%T))" >> $L
cat > /tmp/dqsan.py <<'PY'
import sys, cupy
from cupyflash import _check
from cupyflash._check import Case
cupy.cuda.set_allocator(None)
cases = [Case(200, 233, 120, "bfloat16", False, batch=1, nheads=2), Case(17, 300, 128, "float16", False, batch=2, nheads=2),
         Case(250, 250, 128, "bfloat16", False, batch=1, nheads=3, nheads_k=1)]
failed = 0
for i, case in enumerate(cases):
    result = _check.run_gpu_case(case, seed=i)
    print(f"{'ok  ' if result.ok else 'FAIL'} {case}: {result.describe()}", flush=True)
    failed += not result.ok
sys.exit(1 if failed else 0)
PY
PYTHONPATH=. timeout 60 compute-sanitizer --tool racecheck --racecheck-report hazard python /tmp/dqsan.py 2>&1 | tail -5 >> $L
PYTHONPATH=. timeout 45 compute-sanitizer --tool memcheck python /tmp/dqsan.py 2>&1 | tail -5 >> $L
cd $S/..
echo "== ab bwd main dqf ($(date +%T))" >> $L
timeout 100 python /tmp/ab.py --pass bwd --rounds 5 --cells 128:1024:0,128:4096:0,128:16384:0,64:4096:0,128:4096:1 $S/main $S/dqf >> $L 2>&1
save_new_kernels
echo "done ($(date +%T))" >> $L
