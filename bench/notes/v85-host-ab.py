"""Host time of cupyflash.torch's calls, one tree per process (issue 18, v85): eager, through the
ops (as functorch transforms and tensor subclasses call them), under torch.compile(fullgraph=True),
beside SDPA flash eager and compiled, fwd and fwd+bwd, bf16 causal, at 1x128x8x64 and 4x512x16x128.
us per call: 1000 back-to-back calls synchronised at the end, the median of 3 such timings, the
columns in turns over 2 rounds (the lower round kept). Prints one line per cell, prefixed by the
tree's label (argv[1]); the tree is the one on PYTHONPATH."""
import statistics
import sys
import time

import torch
import torch._dynamo
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


def columns(b, s, h, d):
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (x.requires_grad_() for x in (q, k, v))
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dot = dout.transpose(1, 2)
    ours = lambda q, k, v: cft.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    ours_compiled, sdpa_compiled = torch.compile(ours, fullgraph=True), torch.compile(sdpa, fullgraph=True)
    eager = cft._eager

    def via_ops(fn):
        def run():
            cft._eager = lambda *tensors: False
            try:
                return fn()
            finally:
                cft._eager = eager
        return run

    def pair(fn, args, grad_of):
        return (lambda: fn(*args)), (lambda: torch.autograd.grad(fn(*args), args, grad_of))
    cells = {"ours eager": pair(ours, (qg, kg, vg), dout), "sdpa eager": pair(sdpa, (qt, kt, vt), dot),
             "ours compiled": pair(ours_compiled, (qg, kg, vg), dout),
             "sdpa compiled": pair(sdpa_compiled, (qt, kt, vt), dot)}
    fwd, both = cells["ours eager"]
    cells["ours via ops"] = (via_ops(fwd), via_ops(both))
    return cells


with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for shape_name, shape in SHAPES.items():
        torch._dynamo.reset()
        cells = columns(*shape)
        best = {}
        for _ in range(2):
            for name, (fwd, both) in cells.items():
                for pass_, fn in (("fwd", fwd), ("fwd+bwd", both)):
                    us = per_call(fn)
                    best[name, pass_] = min(best.get((name, pass_), us), us)
        for (name, pass_), us in best.items():
            print(f"{label} {shape_name} {pass_} {name}: {us:.1f}", flush=True)
