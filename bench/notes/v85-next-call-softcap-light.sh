#!/bin/bash
# v85's fourth call: the mma.sync backward with softcap alone in the plain kernels' passes (a light
# option). The forced family's softcap and light GPU tests (and the light test on the default
# family), then the forced options table's softcap row for HEAD's tree (.device_scratch_ab/head,
# carried) and the patched one, in turns.
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
CUPYFLASH_FAMILY=mma_sync timeout 150 python -m pytest tests/test_gpu.py tests/test_gpu_variants.py -m gpu -n 15 \
  -q -p no:warnings -k "softcap or light" > $OUT/tests-forced.txt 2>&1
echo "forced tests rc $?: $(tail -1 $OUT/tests-forced.txt)"; grep -E "^FAILED|^ERROR" $OUT/tests-forced.txt | head
timeout 50 python -m pytest tests/test_gpu.py -m gpu -q -p no:warnings -k light > $OUT/tests-default.txt 2>&1
echo "default light tests rc $?: $(tail -1 $OUT/tests-default.txt)"
for tree in head patch head patch; do
  dir=$PWD; [ $tree = head ] && dir=$PWD/.device_scratch_ab/head
  (cd $dir && CUPYFLASH_FAMILY=mma_sync timeout 75 python -m cupyflash bench --options-only --option-rows softcap \
    --out $OUT/opt-$tree > /dev/null 2>&1; echo "$tree rc $?")
  grep "softcap\|plain" $OUT/opt-$tree/options.md | sed "s/^/$tree /"
done
