#!/bin/bash
# Warm follow-up (~2 min; carry [".device_scratch_full"]): what hd64's two-consumer tile costs a plain
# forward beside the three-consumer 192-row one, the baseline under ALiBi's and dropout's ratios past
# 1k rows (their 'fwd_options' table). Tree "two" is this checkout with plain calls sent to that table
# too; "main" is this checkout; the ALiBi row (main) is the option's cost on the same lease.
cd "$(dirname "$0")/../.."
SCRATCH=${SCRATCH:-.device_scratch_full} source bench/device_call.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
mkdir -p /tmp/trees/main /tmp/trees/two
cp -r cupyflash cuda_src /tmp/trees/main/ && cp -r cupyflash cuda_src /tmp/trees/two/
sed -i 's/overlapped_options = bool(features) and set(features) <= {"alibi", "dropout"}/overlapped_options = set(features) <= {"alibi", "dropout"}/' \
  /tmp/trees/two/cupyflash/_config.py
grep -q 'overlapped_options = set(features)' /tmp/trees/two/cupyflash/_config.py || { echo "patch failed" >> $L; cat $L; exit 1; }
ab ${AB_SECONDS:-150} --rounds ${ROUNDS:-5} --cells ${CELLS:-64:4096:0,64:16384:0,64:4096:1,64:16384:1} /tmp/trees/main /tmp/trees/two
[ -n "$NO_ALIBI" ] || ab 100 --rounds 3 --cells 64:4096:0,64:16384:1 --options '{"alibi_slopes": "random"}' /tmp/trees/main
cat $L
