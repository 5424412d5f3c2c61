#!/bin/bash
# v87's timing call: the backward's kernel time with and without the one-key-block store
# (v87-bwd-kernel-time.py), then the host A/B of HEAD's tree (.device_scratch_ab/head, carried)
# and this one (v86-host-ab.py), twice in turns. ~6 min.
cd "$(dirname "$0")/../.."
PYTHONPATH=$PWD timeout 150 python bench/notes/v87-bwd-kernel-time.py > $OUT/kernel-time.txt 2>$OUT/kernel-time-err.txt
cat $OUT/kernel-time.txt; grep -v Warn $OUT/kernel-time-err.txt | tail -3
for round in 1 2; do
  PYTHONPATH=$PWD/.device_scratch_ab/head timeout 100 python bench/notes/v86-host-ab.py head >> $OUT/ab.txt 2>>$OUT/ab-err.txt
  PYTHONPATH=$PWD timeout 100 python bench/notes/v86-host-ab.py patch >> $OUT/ab.txt 2>>$OUT/ab-err.txt
done
sort -k2,4 -s $OUT/ab.txt
tail -3 $OUT/ab-err.txt
