#!/bin/bash
# v85's third call: test_torch_ops.py's GPU tests on both families (the backward op asked for dbias
# without a bias, the ops' resolved plans against the core's bits), then the options table's rows
# with a bound on the forced mma.sync family (queue item 2: the light backward over plain).
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
for family in "" mma_sync; do
  CUPYFLASH_FAMILY=$family timeout 120 python -m pytest tests/test_torch_ops.py -m gpu -q -p no:warnings \
    > $OUT/ops-tests-${family:-default}.txt 2>&1
  echo "ops tests (${family:-default}) rc $?: $(tail -1 $OUT/ops-tests-${family:-default}.txt)"
done
CUPYFLASH_FAMILY=mma_sync timeout 330 python -m cupyflash bench --options-only \
  --option-rows softcap alibi dropout deterministic --out $OUT/options > $OUT/options.log 2>&1
echo "options rc $?"; tail -3 $OUT/options.log
grep "^|" $OUT/options/options.md | head -20
