#!/bin/bash
# v86's second call: the host A/B (v86-host-ab.py) of HEAD~1's tree (.device_scratch_ab/head,
# carried) and this one in three more turns each, then `bench --host` (the issue's table) at the
# small and medium shapes. ~6 min.
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2 3; do
  PYTHONPATH=$PWD/.device_scratch_ab/head timeout 100 python bench/notes/v86-host-ab.py head >> $OUT/ab.txt 2>>$OUT/ab-err.txt
  PYTHONPATH=$PWD timeout 100 python bench/notes/v86-host-ab.py patch >> $OUT/ab.txt 2>>$OUT/ab-err.txt
done
sort -k2,4 $OUT/ab.txt
tail -3 $OUT/ab-err.txt
timeout 290 python -m cupyflash bench --host --host-shapes small medium --out $OUT/host > $OUT/host.log 2>&1
echo "host table rc $?"; tail -12 $OUT/host.log
