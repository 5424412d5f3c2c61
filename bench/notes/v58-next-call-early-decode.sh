#!/bin/bash
# A device call (v58; about 400 s warm): the bias backward's early probabilities for a bias read from
# global memory (HEAD against 9c82387, float32 biases; bias tests), then v52's two decode patches
# (their KV-cache tests both applied, and each against HEAD in turns; `v52-next-call-decode-fill-b.sh`
# less its decode_splits sweep and ncu).
# Trees: python bench/device_trees.py .device_scratch flag=9c82387 main=HEAD --options '{"attn_bias": "random_float32"}'
# then cp bench/notes/v58-next-call-early-decode.sh .device_scratch/call.sh; run `bash .device_scratch/call.sh`, carry .device_scratch.
cd "$(dirname "$0")/.."
source bench/device_call.sh
: > $L
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
C=128:4096:0,128:4096:1,64:4096:0,128:1024:1
for form in padding_float32 random_float32; do
  echo "== ab bwd, a $form bias, flag main ($(date +%T))" >> $L
  timeout 80 python /tmp/ab.py --pass bwd --rounds 3 --options "{\"attn_bias\": \"$form\"}" --cells $C $S/flag $S/main >> $L 2>&1
done
echo "== main: bias tests ($(date +%T))" >> $L
(cd $S/main && PYTHONPATH=. timeout 100 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_gpu.py tests/test_gpu_variants.py tests/test_torch_options.py -k "bias" > $OUT/tests_bias.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_bias.log >> $L; grep -E "^FAILED|^ERROR" $OUT/tests_bias.log | head -10 >> $L
P=$PWD/bench/notes
for t in ww wc wb; do rm -rf /tmp/$t && mkdir -p /tmp/$t && cp -r cupyflash cuda_src tests bench setup.cfg pyproject.toml /tmp/$t/; done
(cd /tmp/ww && git apply $P/v52-decode-splits-over-whole-waves.patch) >> $L 2>&1
(cd /tmp/wc && git apply $P/v52-decode-fewer-splits-in-clusters.patch) >> $L 2>&1
(cd /tmp/wb && git apply $P/v52-decode-splits-over-whole-waves.patch && git apply $P/v52-decode-fewer-splits-in-clusters.patch) >> $L 2>&1
echo "== both decode patches: KV-cache GPU tests ($(date +%T))" >> $L
(cd /tmp/wb && PYTHONPATH=. timeout 120 python -m pytest -m gpu -p no:cacheprovider -n 15 -q -p no:warnings \
  tests/test_kvcache_gpu.py tests/test_torch_kvcache.py tests/test_kvcache.py > $OUT/tests_wb.log 2>&1)
echo "rc $? ($(date +%T))" >> $L; tail -1 $OUT/tests_wb.log >> $L; grep -E "FAILED|ERROR" $OUT/tests_wb.log | head -10 >> $L
echo "== ab decode: HEAD against the whole-waves rule ($(date +%T))" >> $L
C=17:65536:32:8:128:dense,13:65536:32:8:128:dense,3:65536:32:32:128:dense,5:65536:32:32:128:dense,9:65536:32:8:128:dense,6:16384:32:8:128:dense,35:65536:8:1:128:dense,17:131072:8:1:128:paged256,15:65536:32:8:64:dense,16:65536:32:8:128:dense
timeout 110 python /tmp/ab.py --pass decode --rounds 5 --cells $C $S/main /tmp/ww >> $L 2>&1
echo "== ab decode: HEAD against fewer splits in clusters ($(date +%T))" >> $L
C=16:1024:8:1:128:dense,4:1024:32:8:128:dense,1:1024:32:32:128:dense,4:1024:32:8:64:dense,16:2048:8:1:128:dense,16:4096:8:1:128:dense,32:1024:8:1:128:dense,16:1024:8:1:128:paged16,4:1024:32:8:128:paged16,16:1024:8:1:64:dense
timeout 90 python /tmp/ab.py --pass decode --rounds 7 --cells $C $S/main /tmp/wc >> $L 2>&1
save_new_kernels
echo "done ($(date +%T))" >> $L
