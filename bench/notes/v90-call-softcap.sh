#!/bin/bash
# The GPU tests with softcap in both families for notes/v90-softcap-one-home.patch (applied to the
# checkout first; softcap's tanh and d/ds as one helper; two mma.sync step loops moved; carry
# .device_scratch, whose cache v90 filled with the patch's softcap kernels),
# then three rounds of issue 18's host table for this checkout (v86-host-ab.py; read only if SDPA's
# own columns are quiet: small fwd ~18 us, medium fwd+bwd ~137).
cd "$(dirname "$0")/../.."
source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
for family in wgmma mma_sync; do
  (CUPYFLASH_FAMILY=$family PYTHONPATH=. timeout 200 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -rf -x \
    -p no:warnings -o faulthandler_timeout=120 tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py \
    -k softcap > $OUT/softcap-$family.log 2>&1); echo "softcap $family rc $? ($(date +%T))" >> $L
  tail -1 $OUT/softcap-$family.log >> $L; grep -E "^FAILED|^ERROR" $OUT/softcap-$family.log | head >> $L
done
for round in 1 2 3; do
  PYTHONPATH=. timeout 45 python bench/notes/v86-host-ab.py head$round >> $L 2>/dev/null
done
save_new_kernels
cat $L
