#!/bin/bash
# A device call (v79, about 5 min, nothing carried): HEAD with v79's three changes, the deterministic
# and table-choice GPU tests of both families, then the wgmma family's options table's rows with a
# bound (their kernels compiled first, one process an option, so that the table finds them cached).
cd "$(dirname "$0")/../.."
L=$OUT/log.txt
export CUPYFLASH_CACHE_DIR=/tmp/pcache XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
gpu_tests() {  # NAME SECONDS: the deterministic and table-choice GPU tests, in $OUT/NAME.log
  timeout "$2" python -m pytest -m gpu -p no:cacheprovider -n 15 -q -rf -p no:warnings tests/test_gpu.py \
    tests/test_gpu_variants.py tests/test_head_dims.py -k "deterministic or full_and_the_edged" > "$OUT/$1.log" 2>&1
  echo "$1 rc $? ($(date +%T))" >> $L; tail -1 "$OUT/$1.log" >> $L; grep -E "^FAILED|^ERROR" "$OUT/$1.log" | head >> $L
}
warm_options() {  # each option's hd128 kernels at 4k (the table's 16k calls run the same ones)
  cat > /tmp/warm.py <<'PY'
import multiprocessing

def run(name):
    import torch
    from cupyflash import benchmark
    q, k, v, dout = (torch.randn(1, 4096, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    fwd_kwargs, bwd_kwargs, _, _ = benchmark._option_calls(4096, 128, 16, 1)[name]
    for fn in benchmark._cupyflash_option(q, k, v, dout, fwd_kwargs, bwd_kwargs).values():
        fn()
    torch.cuda.synchronize()
    return name

if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    names = ["plain", "softcap 30", "alibi", "dropout 0.1", "deterministic bwd"]
    with multiprocessing.Pool(5) as pool:
        print("warmed:", pool.map(run, names))
PY
  timeout 100 python /tmp/warm.py >> $L 2>&1
  echo "warm rc $? ($(date +%T))" >> $L
}
gpu_tests tests-wgmma 110
CUPYFLASH_FAMILY=mma_sync gpu_tests tests-mma-sync 110
warm_options
timeout 120 python -m cupyflash bench --options-only --option-rows softcap alibi dropout deterministic --out $OUT/options-wgmma > $OUT/options-wgmma.log 2>&1
echo "options wgmma rc $? ($(date +%T))" >> $L
grep -E "deterministic|plain|dropout|softcap|alibi" $OUT/options-*/options.md >> $L
cat $L
