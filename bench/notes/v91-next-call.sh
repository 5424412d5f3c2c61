#!/bin/bash
# v91's call: carry [".device_scratch"], built by
#   python bench/device_trees.py .device_scratch main=HEAD new=HEAD+bench/notes/v91-alibi-products.patch \
#     --options '{"alibi_slopes": "random"}' --named bench/notes/v91-alibi-kernels.txt
# (the named: every wgmma forward with ALiBi and without softcap, so that the tests compile nothing).
# 1. new's ALiBi GPU tests (wgmma family: the change is the wgmma forward's); 2. the ALiBi forward
# A/B, main against new, and the plain forward of main in the same lease (the option's ratio);
# two fp16 cells.
cd "$(dirname "$0")/../.."
source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
export CUPYFLASH_FAMILY=wgmma
gpu_tests new alibi-wgmma 170 -x tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k "alibi or ALiBi"
unset CUPYFLASH_FAMILY
CELLS=64:4096:0,64:16384:1,128:4096:0,128:16384:0,128:4096:1,128:16384:1,256:4096:0,256:16384:1
ab 150 --rounds 5 --cells $CELLS --options '{"alibi_slopes": "random"}' $S/main $S/new
ab 90 --rounds 3 --cells $CELLS $S/main
ab 60 --rounds 3 --dtype float16 --cells 128:4096:0,128:16384:1 --options '{"alibi_slopes": "random"}' $S/main $S/new
save_new_kernels
cat $L
