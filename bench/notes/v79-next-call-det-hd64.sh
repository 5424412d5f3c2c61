#!/bin/bash
# A device call (v79; about 6 min; carry [".device_scratch28"], or rebuild it: device_trees.py
# .device_scratch28 main=HEAD t128=HEAD+bench/notes/v79-det-hd64-plain-tiles.patch
# m80down=HEAD+bench/notes/v79-mma-sync-det-local-down.patch
# t80=HEAD+bench/notes/v79-det-hd128-80-rows.patch --kernels ab --options '{"deterministic": true}').
# Part 1: hd64's deterministic backward without options on the plain
# 128-row tile (dQ's rows split over the consumers, one reduction a step), not the options' 64-row
# one (two pieces a step, each waited for). Compiles spill-free (168 registers, LOCAL).
# Prediction: hd64 deterministic +30-60% (v78: 2.0-2.4x the plain backward at HEAD, whose 128-row
# tile is the whole difference but for the turns); hd128 and hd256 unchanged (the same tiles).
# Part 3 (t80): hd128's deterministic backward without causal or window edges on the plain 80-row
# tile ('bwd_full', dQ transposed; spill-free), not the 64-row one. Prediction: +8-15% at hd128
# non-causal (the 80-row tile's gain in the plain backward), the same elsewhere.
# Part 2: v78's walk down in the mma.sync family's deterministic LOCAL kernels (forced with
# CUPYFLASH_FAMILY=mma_sync; every deterministic LOCAL backward variant of every table spill-free).
# Prediction: causal +10-25% as in the wgmma family (its key blocks are launched close together
# too: grid_slot's block-major order puts a batch entry's heads' blocks of one level side by side).
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch28 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=64:1024:0,64:1024:1,64:4096:0,64:4096:1,64:16384:0,64:16384:1
echo "== ab bwd deterministic" >> $L
timeout 120 python /tmp/ab.py --pass bwd --rounds 3 --options '{"deterministic": true}' --cells $C \
  $S/main $S/t128 2>&1 | tee -a $OUT/ab.txt | tail -8 >> $L
echo "== ab bwd plain (main)" >> $L
timeout 60 python /tmp/ab.py --pass bwd --rounds 3 --cells $C $S/main 2>&1 | tee -a $OUT/ab.txt | tail -8 >> $L
echo "== GPU tests of t128: deterministic" >> $L
gpu_tests t128 tests 200 tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k deterministic
echo "== ab bwd deterministic hd128 non-causal: main, t80" >> $L
timeout 90 python /tmp/ab.py --pass bwd --rounds 3 --options '{"deterministic": true}' \
  --cells 128:1024:0,128:4096:0,128:16384:0,128:4096:1 $S/main $S/t80 2>&1 | tee -a $OUT/ab.txt | tail -6 >> $L
echo "== GPU tests of t80: deterministic" >> $L
gpu_tests t80 tests-t80 150 tests/test_gpu.py tests/test_gpu_variants.py -k deterministic
echo "== mma.sync (forced): ab bwd deterministic, main and m80down" >> $L
C=128:1024:1,128:4096:1,128:16384:1,128:4096:0,64:4096:1
CUPYFLASH_FAMILY=mma_sync timeout 150 python /tmp/ab.py --pass bwd --rounds 3 --options '{"deterministic": true}' \
  --cells $C $S/main $S/m80down 2>&1 | tee -a $OUT/ab.txt | tail -7 >> $L
echo "== mma.sync (forced): GPU tests of m80down, deterministic" >> $L
CUPYFLASH_FAMILY=mma_sync gpu_tests m80down tests-m80 200 tests/test_gpu.py tests/test_gpu_variants.py -k deterministic
cat $L
