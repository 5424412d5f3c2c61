"""Where a compiled call's host time goes (issue 18): cProfile of the main thread over 1000 calls
of cupyflash.torch under torch.compile(fullgraph=True) and of SDPA flash compiled the same way,
forward and forward+backward (the latter with autograd's multithreading off, so that the
backward runs on the profiled thread), at 1x128x8x64 bf16 causal; then each call timed alone
(us per call, multithreading as torch's default). Writes $OUT/host-profile.txt."""
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch._dynamo
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cupyflash.torch import flash_attn_func

CALLS = 1000
b, s, h, d = 1, 128, 8, 64
out_path = os.path.join(os.environ.get("OUT", "."), "host-profile.txt")
report = open(out_path, "w")


def emit(text):
    print(text, flush=True)
    report.write(text + "\n")
    report.flush()


def tensors():
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return q, k, v, dout


def ours(compiled):
    q, k, v, dout = tensors()
    qg, kg, vg = (x.requires_grad_() for x in (q, k, v))
    fn = (lambda q, k, v: flash_attn_func(q, k, v, causal=True))
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    return (lambda: fn(qg, kg, vg)), (lambda: torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), dout))


def sdpa(compiled):
    q, k, v, dout = tensors()
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    dot = dout.transpose(1, 2)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    return (lambda: fn(qt, kt, vt)), (lambda: torch.autograd.grad(fn(qt, kt, vt), (qt, kt, vt), dot))


def per_call(fn, calls=2000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(best)[2]


def profile(name, fn):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(28)
    stats.sort_stats("cumulative").print_stats(28)
    emit(f"===== {name}: {CALLS} calls\n{text.getvalue()}")


with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    cases = {}
    for label, make in (("ours eager", lambda: ours(False)), ("ours compiled", lambda: ours(True)),
                        ("sdpa eager", lambda: sdpa(False)), ("sdpa compiled", lambda: sdpa(True))):
        fwd, both = make()
        emit(f"{label}: fwd {per_call(fwd):.1f} us, fwd+bwd {per_call(both):.1f} us")
        cases[label] = (fwd, both)
    torch.autograd.set_multithreading_enabled(False)
    for label in ("ours compiled", "sdpa compiled", "ours eager"):
        fwd, both = cases[label]
        emit(f"{label} (multithreading off): fwd+bwd {per_call(both):.1f} us")
    for label in ("ours compiled", "sdpa compiled"):
        fwd, both = cases[label]
        profile(f"{label} fwd", fwd)
        profile(f"{label} fwd+bwd (multithreading off)", both)
    profile("ours eager fwd+bwd (multithreading off)", cases["ours eager"][1])
report.close()
