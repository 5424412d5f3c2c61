#!/bin/bash
# Prepared in v94 (carry [".device_scratch_v94"]: trees main=HEAD (02de51d) and
# new=HEAD+v94-three-consumer-options.patch, `--kernels all --named bench/notes/v94-test-kernels.txt`,
# the bf16 ab kernels with ALiBi, dropout, softcap, ALiBi+dropout; ~6 min warm): the patched tree's
# option tests on the wgmma family (hd64's 192-row forwards with options other than an attn_bias
# overlap their products now, ALiBi's by the tensor cores too), then the A/B of hd64's option
# forwards against HEAD's (two consumers for ALiBi and dropout, three serial for softcap), plain
# as control. Where the tests pass and the A/B gains, land the patch (git apply, commit) and run the
# whole suite on the resulting HEAD with the same carry (`SCRATCH=.device_scratch_v94 bash
# bench/notes/v89-next-call-suite-a.sh`, then -suite-b.sh, -suite-mma.sh 1 2 3): the new tree's
# every variant is in its cache.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch_v94 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
CUPYFLASH_FAMILY=wgmma gpu_tests new options-wgmma 150 tests/test_gpu.py tests/test_gpu_variants.py \
  tests/test_head_dims.py -k "alibi or ALiBi or dropout or softcap or short_and_the_long"
for options in '{"alibi_slopes": "random"}' '{"softcap": 30.0}' '{"dropout_p": 0.1, "seed": 1}' \
    '{"alibi_slopes": "random", "dropout_p": 0.1, "seed": 1}'; do
  ab 75 --rounds 5 --cells 64:4096:0,64:16384:0,64:4096:1,64:16384:1 --options "$options" $S/main $S/new
done
ab 40 --rounds 3 --cells 64:4096:0,64:16384:1 $S/main $S/new
save_new_kernels
cat $L
