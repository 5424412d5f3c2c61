# Sourced from the repository root by a device call's script (bench/notes/*-next-call*.sh, run as
# .device_scratch/next_callN.sh): the carried kernel cache unpacked and used, S the carried trees
# (.device_scratch, or the folder SCRATCH names), L the call's log (in $OUT). gpu_tests runs a
# tree's GPU tests and logs how they ended, sanitizers its memcheck and racecheck, ab and host_ab
# time trees against each other (kernels, host); save_new_kernels packs what the call compiled into
# $OUT, to unpack into .device_cache/ here (bench/DEVICE.md).
S=$PWD/${SCRATCH:-.device_scratch}
mkdir -p /tmp/pcache && tar -xJf "$S/cache.tar.xz" -C /tmp/pcache --strip-components=1
# One BLAS thread a process: 15 test workers each with a thread a core fight over the cores.
export CUPYFLASH_CACHE_DIR=/tmp/pcache XLA_PYTHON_CLIENT_PREALLOCATE=false OPENBLAS_NUM_THREADS=1
touch /tmp/t0
cp bench/ab.py /tmp/
L=$OUT/log.txt
save_new_kernels() { find /tmp/pcache -newer /tmp/t0 -type f | tar -cJf "$OUT/newcache.tar.xz" -T - 2>/dev/null; }
# gpu_tests TREE NAME SECONDS PYTEST_ARGS...: the GPU tests of $S/TREE on 15 workers, their output in
# $OUT/NAME.log; their exit status, last line and failures in $L, and, where the time ran out before
# pytest's summary, the outcomes its progress lines had shown (. passed, F failed, E error, s skipped).
gpu_tests() {
  local tree=$1 log=$OUT/$2.log seconds=$3
  shift 3
  (cd "$S/$tree" && PYTHONPATH=. timeout "$seconds" python -m pytest -m gpu -p no:cacheprovider -n 15 -q -rf \
    -p no:warnings "$@" > "$log" 2>&1)
  local rc=$?
  echo "rc $rc ($(date +%T))" >> $L; tail -1 "$log" >> $L; grep -E "^FAILED|^ERROR" "$log" | head -10 >> $L
  if [ $rc = 124 ]; then
    grep -E '^[.FEsx]+( +\[ *[0-9]+%\])?$' "$log" | tr -d ' \n[]%0-9' | fold -w1 | sort | uniq -c | tr '\n' ' ' >> $L
    echo "(progress before the timeout)" >> $L
  fi
}
# sanitizers TREE [ARGS...]: memcheck, then racecheck's hazards, of $S/TREE's tests/sanitize_run.py
# (with ARGS, such as --kvcache-only); their output in $OUT/memcheck.log and racecheck.log, exit
# status and last lines in $L.
sanitizers() {
  local tree=$1 tool seconds
  shift
  for tool in memcheck:80 racecheck:120; do
    seconds=${tool#*:} tool=${tool%:*}
    (cd "$S/$tree" && PYTHONPATH=. timeout "$seconds" compute-sanitizer --tool $tool \
      $([ $tool = racecheck ] && echo --racecheck-report hazard) python tests/sanitize_run.py "$@" > "$OUT/$tool.log" 2>&1)
    echo "$tool rc $? ($(date +%T))" >> $L; tail -2 "$OUT/$tool.log" >> $L
  done
}
# host_ab ROUNDS TREE...: issue 18's host table (bench/notes/v86-host-ab.py) of each $S/TREE, one
# process a tree, the trees in turns for ROUNDS rounds; lines in $OUT/host-ab.txt (then $L), errors
# in $OUT/host-ab-err.txt. Read it only where SDPA's own columns look quiet (small fwd ~18 us, medium
# fwd+bwd ~137 us).
host_ab() {
  local rounds=$1 round tree
  shift
  for round in $(seq "$rounds"); do
    for tree in "$@"; do
      PYTHONPATH=$S/$tree timeout 45 python bench/notes/v86-host-ab.py $tree >> $OUT/host-ab.txt 2>>$OUT/host-ab-err.txt
    done
  done
  cat $OUT/host-ab.txt >> $L
}
# ab SECONDS ARGS...: bench/ab.py (its copy in /tmp) with ARGS (trees as $S/TREE), stopped after
# SECONDS; its whole output added to $OUT/ab.txt, its table (or, without one, its last lines) to $L.
ab() {
  local seconds=$1
  shift
  timeout "$seconds" python /tmp/ab.py "$@" > $OUT/ab-last.txt 2>&1
  echo "ab rc $? ($(date +%T))" >> $L
  cat $OUT/ab-last.txt >> $OUT/ab.txt
  if grep -q "median of" $OUT/ab-last.txt; then sed -n '/median of/,$p' $OUT/ab-last.txt >> $L
  else tail -5 $OUT/ab-last.txt >> $L; fi
}
