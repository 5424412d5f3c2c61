#!/bin/bash
# v85's last call: the options table's bounded rows with the mma.sync family forced, at HEAD (softcap
# alone a light option since v85).
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
CUPYFLASH_FAMILY=mma_sync timeout 200 python -m cupyflash bench --options-only \
  --option-rows softcap alibi dropout deterministic --out $OUT/options > $OUT/options.log 2>&1
echo "options rc $?"; grep "^|" $OUT/options/options.md
