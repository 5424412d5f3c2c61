#!/bin/bash
# Prepared in v93 (carry [".device_scratch_alibi"]: trees main=HEAD and new=HEAD+v93-alibi-products-head.patch,
# `--kernels all --named bench/device-test-kernels.txt`, both dtypes, ALiBi's ab kernels; ~4 min warm):
# the patched tree's ALiBi GPU tests in both families, then the A/B of the ALiBi forwards whose
# blocks run the products (hd64, hd128; hd128's LOCAL ones keep ALiBi per element), plain as control.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch_alibi source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
for family in wgmma mma_sync; do
  echo "$family:" >> $L
  CUPYFLASH_FAMILY=$family gpu_tests new alibi-$family 90 tests/test_gpu.py tests/test_gpu_variants.py \
    tests/test_head_dims.py -k "alibi or ALiBi"
done
ab 200 --rounds 5 --cells 64:4096:0,64:16384:1,128:4096:0,128:16384:0,128:4096:1 \
  --options '{"alibi_slopes": "random"}' $S/main $S/new
ab 60 --rounds 3 --cells 64:4096:0,128:4096:0 $S/main $S/new
save_new_kernels
cat $L
