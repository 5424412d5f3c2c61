"""Where a Python autograd.Function's fwd+bwd host time goes (bench/notes/v16): the forward, the
hand-off to autograd's backward thread, the backward's body there, and the way back; the same
core backward timed on the main thread and on a plain Python thread for comparison.

Usage (GPU): PYTHONPATH=. python bench/autograd_handoff.py
"""
import time, statistics, threading
import torch
from cupyflash import api

g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
marks = {}

class Minimal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        o, l = api.flash_attn_func(q, k, v, None, True, return_lse=True)
        ctx.save_for_backward(q, k, v, o, l)
        return o
    @staticmethod
    def backward(ctx, dout):
        marks["enter"] = time.perf_counter()
        q, k, v, o, l = ctx.saved_tensors
        r = api.flash_attn_backward(dout, q, k, v, o, l, None, True)
        marks["exit"] = time.perf_counter()
        return r

class TorchOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q * 1
    @staticmethod
    def backward(ctx, gr):
        marks["enter"] = time.perf_counter()
        r = (gr * 2, gr * 3, gr * 4)
        marks["exit"] = time.perf_counter()
        return r

def split(fn, n=300):
    for _ in range(30): fn()
    torch.cuda.synchronize()
    parts = {"fwd": [], "to_bwd": [], "bwd body": [], "back": [], "total": []}
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn.forward()
        t1 = time.perf_counter()
        fn.backward(out)
        t2 = time.perf_counter()
        parts["fwd"].append(t1 - t0); parts["to_bwd"].append(marks["enter"] - t1)
        parts["bwd body"].append(marks["exit"] - marks["enter"]); parts["back"].append(t2 - marks["exit"])
        parts["total"].append(t2 - t0)
    torch.cuda.synchronize()
    return "  ".join(f"{k} {statistics.median(v) * 1e6:7.1f}" for k, v in parts.items())

class Case:
    def __init__(self, f, grad_fn): self.f, self.grad_fn = f, grad_fn
    def forward(self): return self.f.apply(qg, kg, vg)
    def backward(self, out): return self.grad_fn(out)
    def __call__(self): return self.backward(self.forward())

grad = lambda out: torch.autograd.grad(out, (qg, kg, vg), do)
back = lambda out: out.backward(do)
for name, f in (("Minimal", Minimal), ("TorchOnly", TorchOnly)):
    print(f"{name:10s} grad     ", split(Case(f, grad)), flush=True)
    print(f"{name:10s} .backward", split(Case(f, back)), flush=True)
# the same backward body in the main thread, for comparison
out, lse = api.flash_attn_func(q, k, v, None, True, return_lse=True)
ts = []
for _ in range(300):
    t = time.perf_counter(); api.flash_attn_backward(do, q, k, v, out, lse, None, True); ts.append(time.perf_counter() - t)
torch.cuda.synchronize()
print("core bwd in the main thread", round(statistics.median(ts) * 1e6, 1))
# and in a plain Python thread
res = []
def body():
    for _ in range(300):
        t = time.perf_counter(); api.flash_attn_backward(do, q, k, v, out, lse, None, True); res.append(time.perf_counter() - t)
th = threading.Thread(target=body); th.start(); th.join(); torch.cuda.synchronize()
print("core bwd in another thread", round(statistics.median(res[30:]) * 1e6, 1))
import sys; print("switch interval", sys.getswitchinterval(), "threads", threading.active_count())
