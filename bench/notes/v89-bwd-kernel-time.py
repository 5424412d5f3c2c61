"""GPU time of cupyflash.torch's backward launches per fwd+bwd (torch.profiler's kernel records), for
v89's 16-byte dQ stores: each shape three ways in one process: `never` (adds and bwd_convert_dq),
`rule` (the plan's rule, _plan.DQ_STORED_STEPS steps a CTA at most) and `one-block` (every backward
of one key block stores dQ, however many steps). `one-block` against `never` gives the stores' cost a
step, which sets DQ_STORED_STEPS. One line per shape and way: us a call."""
import torch
from torch.profiler import ProfilerActivity, profile

import cupyflash.torch as cft
from cupyflash import _plan

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal); steps a CTA in the comment
SHAPES = [(1, 128, 128, 8, 8, 64, True),        # 1
          (4, 128, 128, 16, 16, 128, True),     # 2
          (2, 512, 128, 16, 16, 64, False),     # 4
          (2, 1024, 128, 16, 16, 64, False),    # 8
          (2, 2048, 128, 16, 16, 64, False),    # 16
          (2, 256, 128, 16, 16, 128, False),    # 4
          (2, 512, 128, 16, 16, 128, False),    # 8
          (2, 1000, 128, 16, 16, 128, False),   # 16
          (2, 128, 100, 32, 8, 128, True),      # 8 (GQA)
          (2, 256, 64, 16, 16, 256, False),     # 4
          (2, 512, 64, 16, 16, 256, False),     # 8
          (2, 2048, 128, 16, 4, 64, False)]     # 64 (GQA)
CALLS = 50
RULE = _plan.dq_stored_by_bwd
STEPS = _plan.DQ_STORED_STEPS


def backward_time(shape):
    b, sq, sk, h, hk, d, causal = shape
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    step = lambda: torch.autograd.grad(cft.flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)  # noqa: E731
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name.startswith("cupyflash_bwd"):
            name = event.name.split("_bfloat16")[0][len("cupyflash_"):]
            kernels[name] = kernels.get(name, 0.0) + event.device_time / CALLS
    return kernels


for shape in SHAPES:
    b, sq, sk, h, hk, d, causal = shape
    for way, stores, steps in (("never", lambda call, tile: False, STEPS), ("rule", RULE, STEPS),
                               ("one-block", RULE, 10 ** 9)):
        _plan.dq_stored_by_bwd, _plan.DQ_STORED_STEPS = stores, steps
        cft._resolved.clear()
        _plan._plans.clear()
        kernels = backward_time(shape)
        parts = ", ".join(f"{name} {us:.2f}" for name, us in sorted(kernels.items()))
        print(f"{b}x{sq}x{sk}x{h}/{hk}x{d}{' causal' if causal else ''} {way}: {sum(kernels.values()):.2f} us"
              f" ({parts})", flush=True)
