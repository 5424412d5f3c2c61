#!/bin/bash
# v86's fourth call: is the eager fwd+bwd's spread between processes (1.06-1.54x SDPA in v86's A/Bs,
# SDPA's own time steady) the autograd thread's CPU placement? The host's topology, then
# v86-host-ab.py on this tree in three processes each: unpinned, pinned to one core pair's
# neighbours (0-3), and pinned to two far cores (first and last listed). ~3 min.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD
lscpu | grep -E "^(CPU\(s\)|On-line|Thread|Core|Socket|NUMA|L3|Model name)"
nproc; cat /sys/fs/cgroup/cpuset.cpus.effective 2>/dev/null
cpus=$(python -c "import os; print(sorted(os.sched_getaffinity(0)))")
echo "affinity $cpus"
first=$(python -c "import os; print(min(os.sched_getaffinity(0)))"); last=$(python -c "import os; print(max(os.sched_getaffinity(0)))")
near=$(python -c "import os; c=sorted(os.sched_getaffinity(0)); print(','.join(map(str, c[:4])))")
python -c "
import torch, cupyflash.torch as cft
for shape in ((1, 128, 8, 64), (4, 512, 16, 128)):
    q, k, v = (torch.randn(*shape, device='cuda', dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.autograd.grad(cft.flash_attn_func(q, k, v, causal=True), (q, k, v), torch.randn_like(q))
torch.cuda.synchronize(); print('warm')"
for round in 1 2 3; do
  timeout 90 python bench/notes/v86-host-ab.py free >> $OUT/ab.txt 2>>$OUT/ab-err.txt
  timeout 90 taskset -c $near python bench/notes/v86-host-ab.py near >> $OUT/ab.txt 2>>$OUT/ab-err.txt
  timeout 90 taskset -c $first,$last python bench/notes/v86-host-ab.py far >> $OUT/ab.txt 2>>$OUT/ab-err.txt
done
sort -k2,4 $OUT/ab.txt
tail -3 $OUT/ab-err.txt
