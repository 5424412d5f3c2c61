#!/bin/bash
# v85's fifth call: the wgmma backward with softcap alone computes P^T (and its d/ds, kept as fp16
# pairs) while dP^T's product runs. Its softcap and determinism GPU tests on the default family,
# then the options table's softcap row for HEAD's tree (.device_scratch_ab/head, carried) and the
# patch, in turns.
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python -m pytest tests/test_gpu.py tests/test_gpu_variants.py -m gpu -n 15 -q -p no:warnings \
  -k "softcap" > $OUT/tests.txt 2>&1
echo "tests rc $?: $(tail -1 $OUT/tests.txt)"; grep -E "^FAILED|^ERROR" $OUT/tests.txt | head
for tree in head patch head patch; do
  dir=$PWD; [ $tree = head ] && dir=$PWD/.device_scratch_ab/head
  (cd $dir && timeout 60 python -m cupyflash bench --options-only --option-rows softcap --out $OUT/opt-$tree \
    > /dev/null 2>&1; echo "$tree rc $?")
  grep "softcap 30" $OUT/opt-$tree/options.md | sed "s/^/$tree /"
done
