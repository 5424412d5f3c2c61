#!/bin/bash
# The next (warm, same carry; ~9 min): suite part 3 of 3, then memcheck and racecheck
# (tests/sanitize_run.py) and `check`, on this checkout.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
(PYTHONPATH=. timeout 275 python bench/gpu_suite.py --part 3/3 -- -n 15 -q -rf -p no:cacheprovider \
  -p no:warnings -o faulthandler_timeout=120 > $OUT/suite3.log 2>&1); echo "suite 3/3 rc $? ($(date +%T))" >> $L
tail -1 $OUT/suite3.log >> $L; grep -E "^FAILED|^ERROR" $OUT/suite3.log | head >> $L
for tool in memcheck:80 racecheck:120; do
  seconds=${tool#*:} tool=${tool%:*}
  (PYTHONPATH=. timeout $seconds compute-sanitizer --tool $tool $([ $tool = racecheck ] && echo --racecheck-report hazard) \
    python tests/sanitize_run.py > $OUT/$tool.log 2>&1); echo "$tool rc $? ($(date +%T))" >> $L; tail -2 $OUT/$tool.log >> $L
done
(PYTHONPATH=. timeout 45 python -m cupyflash check 2>&1 | tail -2) >> $L
save_new_kernels
cat $L
