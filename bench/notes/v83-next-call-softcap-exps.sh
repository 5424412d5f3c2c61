#!/bin/bash
# A device call (v83, about 4 min; carry [".device_scratch33"], or rebuild it: device_trees.py
# .device_scratch33 main=HEAD e2=HEAD+P2 e4=HEAD+bench/notes/v83-softcap-exps-on-fma.patch e6=HEAD+P6
# --kernels ab --options '{"softcap": 30.0}', P2 and P6 the patch with 2 and 6 in kExpOnFmaEighths).
# The wgmma forward with softcap folded takes 2, 4 or 6 of every 8 column tiles' exps on the FMA
# pipes (exp2_on_fma: 9 instructions for one MUFU op) at hd64 and hd128.
# Prediction (MUFU cycles per step equal the wgmmas' at hd128 with softcap; v83 note): hd128
# softcap 1.36x plain -> 1.10-1.20x with e4 (e2 between, e6 no better than e4: FMA-pipe issue);
# hd64 (MUFU twice the wgmmas; issue ~87% of the plain period) 0-20% better; hd256 (no change) within noise.
# With .device_scratch34 carried too (p1, p2: HEAD with 1 or 2 eighths of the plain hd64 forward's
# exps on the FMA pipes, where ex2 alone matches the wgmmas' cycles): hd64 plain within -3..+5%.
cd "$(dirname "$0")/../.."
SCRATCH=.device_scratch33 source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
ab() { timeout "$1" python /tmp/ab.py --rounds 3 "${@:2}" 2>&1 | tee -a $OUT/ab.txt | tail -10 >> $L; }
C=64:4096:0,64:4096:1,128:4096:0,128:4096:1,128:16384:0,128:16384:1,256:4096:0
echo "== ab fwd softcap 30: main, e2, e4, e6" >> $L
ab 120 --pass fwd --options '{"softcap": 30.0}' --cells $C $S/main $S/e2 $S/e4 $S/e6
echo "== ab fwd plain: main (the ratio's denominator)" >> $L
ab 60 --pass fwd --cells $C $S/main
if [ -d .device_scratch34 ]; then
  tar -xJf .device_scratch34/cache.tar.xz -C /tmp/pcache --strip-components=1
  echo "== ab fwd plain hd64: main, p1, p2" >> $L
  ab 70 --pass fwd --cells 64:1024:0,64:1024:1,64:4096:0,64:4096:1,64:16384:0,64:16384:1 $S/main $PWD/.device_scratch34/p1 $PWD/.device_scratch34/p2
fi
echo "== GPU tests of e4: softcap" >> $L
gpu_tests e4 tests-e4 150 tests/test_gpu.py tests/test_gpu_variants.py tests/test_head_dims.py -k "softcap or nan_key"
echo "== GPU tests of main: the NaN key, mma.sync (forced; e4's own run covers the wgmma family)" >> $L
CUPYFLASH_FAMILY=mma_sync gpu_tests main tests-main-nan-mma-sync 60 tests/test_gpu.py -k "nan_key"
echo "== options table of e4: softcap (the issue's bound, 1.15x plain)" >> $L
(cd $S/e4 && PYTHONPATH=. timeout 90 python -m cupyflash bench --options-only --option-rows softcap \
  --out $OUT/options-e4 > $OUT/options-e4.log 2>&1)
echo "options rc $? ($(date +%T))" >> $L
cat $OUT/options-e4/options.md >> $L
save_new_kernels
cat $L
