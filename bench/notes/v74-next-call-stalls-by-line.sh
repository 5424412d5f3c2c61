#!/bin/bash
# Call 2 of 2 (about 5 min), right after `v51-next-call-fa4-a.sh` (carry [".device/fa4/a"]); carry
# [".device/fa4/b", ".device_scratch14"]. `IMPLS=cupyflash bash ...` (one call, carry
# [".device_scratch14"]) reads ours alone.
# v73: one launch of our hd128 16k forward is bound by the SM clock (21% more clock, 2% more
# cycles) and the L2 moves only the blocks' K/V, so v71's gap to FA4 (5.6% fewer cycles at the same
# clock, with ~3% more instructions) is issue rate: ours 6.27 cycles an instruction, stalls "wait"
# 2.02 and "barrier" 1.08 an instruction. Statically (`bench/sass.py stalls`) our step's control
# codes hold 1144 stall cycles for 502 instructions, 528 of them the 66 exps at 8 cycles each.
# Which lines do the warps stall on, by reason, in ours and in FA4's? For each: the stall reasons
# (the same metrics as v73's), and a report of the warps' PC samples by SASS line, printed as CSV.
# Prediction: both kernels' samples concentrate in the softmax (exps, row maxima) and at the
# warpgroup barrier; ours shows more "barrier" samples at the consumers' named barrier (the other
# warpgroup's softmax is late) or more "wait" samples on the HGMMA issue run (R2UR/UIADD3.64
# between HGMMAs, 11-13 cycles each).
cd "$(dirname "$0")/../.."
IMPLS=${IMPLS:-cupyflash fa4}
[[ $IMPLS == *fa4* ]] && { source .device/fa4/b/install.sh finish .device/fa4/b || exit 1; }
mkdir -p /tmp/pcache && tar -xJf .device_scratch14/cache.tar.xz -C /tmp/pcache --strip-components=1
export CUPYFLASH_CACHE_DIR=/tmp/pcache PYTHONPATH=$PWD:$PYTHONPATH
M=regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__inst_executed.sum,sm__cycles_elapsed.max
for impl in $IMPLS; do
  K=$(python -c "import sys; sys.path.insert(0, 'bench'); import power; print(power.NCU_KERNELS['$impl'])")
  timeout 100 ncu -k $K --launch-skip 5 --launch-count 1 --metrics $M \
    python bench/power.py --worker $impl:fwd:128:0 16384 --short > $OUT/ncu-stalls-$impl.txt 2>&1
  echo "ncu stalls $impl rc $?"; grep -E "^ +(smsp|sm)__" $OUT/ncu-stalls-$impl.txt
  timeout 150 ncu -k $K --launch-skip 5 --launch-count 1 --section WarpStateStats --section SourceCounters \
    --import-source no -o $OUT/lines-$impl python bench/power.py --worker $impl:fwd:128:0 16384 --short \
    > $OUT/ncu-lines-$impl.log 2>&1
  echo "ncu lines $impl rc $?"
  # The source page as CSV (one row a SASS instruction, its samples by reason); the page's flags
  # changed between ncu versions, so the plainer form is tried when the first fails.
  ncu -i $OUT/lines-$impl.ncu-rep --page source --print-source sass --csv > $OUT/lines-$impl.csv 2> $OUT/lines-$impl.err \
    || ncu -i $OUT/lines-$impl.ncu-rep --page source --csv > $OUT/lines-$impl.csv 2>> $OUT/lines-$impl.err
  echo "source page $impl rc $? ($(wc -l < $OUT/lines-$impl.csv) lines)"; head -3 $OUT/lines-$impl.csv | cut -c1-400
  # The 30 instructions with the most samples, whichever columns this ncu names them by.
  python - $OUT/lines-$impl.csv <<'PY'
import csv, sys
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.count(",") > 2))
if len(rows) > 1:
    head, body = rows[0], rows[1:]
    source = next((i for i, h in enumerate(head) if h.strip('"') in ("Source", "SASS")), 1)
    samples = [i for i, h in enumerate(head) if "Sampl" in h]
    def number(row, i):
        try: return float(row[i].replace(",", ""))
        except (ValueError, IndexError): return 0.0
    if samples:
        total = sum(number(r, samples[0]) for r in body) or 1
        print("columns:", [head[i] for i in samples])
        for r in sorted(body, key=lambda r: -number(r, samples[0]))[:30]:
            print(f"{100 * number(r, samples[0]) / total:5.1f}%", [r[i] for i in samples[1:3]], r[source][:90])
PY
done
