"""Host time of cupyflash.torch's eager calls, one tree per process (issue 18, v86): eager with grad
(fwd, fwd+bwd), no-grad fwd, beside SDPA flash eager, bf16 causal, at 1x128x8x64 and 4x512x16x128.
us per call: 1000 back-to-back calls synchronised at the end, the median of 3 such timings, the
columns in turns over 3 rounds (the lowest kept). Prints one line per cell, prefixed by the tree's
label (argv[1]); the tree is the one on PYTHONPATH."""
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupyflash.torch as cft

label = sys.argv[1]
SHAPES = {"small": (1, 128, 8, 64), "medium": (4, 512, 16, 128)}


def per_call(fn, calls=1000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def cells(b, s, h, d):
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dot = dout.transpose(1, 2)
    ours = lambda q, k, v: cft.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    return {("ours eager", "fwd"): lambda: ours(qg, kg, vg),
            ("ours eager", "fwd+bwd"): lambda: torch.autograd.grad(ours(qg, kg, vg), (qg, kg, vg), dout),
            ("ours no grad", "fwd"): lambda: ours(q, k, v),
            ("sdpa eager", "fwd"): lambda: sdpa(qt, kt, vt),
            ("sdpa eager", "fwd+bwd"): lambda: torch.autograd.grad(sdpa(qt, kt, vt), (qt, kt, vt), dot)}


with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for shape_name, shape in SHAPES.items():
        table = cells(*shape)
        best = {}
        for _ in range(3):
            for key, fn in table.items():
                us = per_call(fn)
                best[key] = min(best.get(key, us), us)
        for (name, pass_), us in best.items():
            print(f"{label} {shape_name} {pass_} {name}: {us:.1f}", flush=True)
