"""Host time per call: how long the Python launch path takes when the GPU work is negligible.

Usage: python bench/host.py [--profile]
Times 2000 back-to-back calls on a tiny problem (batch 1, seqlen 128, 1 head, head dim 64, bf16),
so the host, not the GPU, sets the pace: the core functions on torch tensors, the cupyflash.torch
drop-in (its eager path, and through its custom ops as torch.compile sees them), and PyTorch SDPA's
flash backend on the same tensors. With --profile, prints cProfile's top entries for the core's
forward and backward.
"""

import cProfile
import pstats
import sys
import time


def per_call_us(fn, calls=2000):
    import torch
    fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - begin) / calls * 1e6


def main():
    import torch
    import cupyflash
    import cupyflash.torch as cft
    q, k, v, do = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qt, kt, vt = (x.transpose(1, 2).requires_grad_() for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def dropin_fwd_bwd():
        return torch.autograd.grad(cft.flash_attn_func(qg, kg, vg, causal=True), (qg, kg, vg), do)

    def through_ops(fn):
        def forced():
            eager, cft._eager = cft._eager, lambda values: False
            try:
                return fn()
            finally:
                cft._eager = eager
        return forced

    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        ot = sdpa(qt, kt, vt, is_causal=True)
        rows = {
            "cupyflash fwd": lambda: cupyflash.flash_attn_func(q, k, v, causal=True),
            "cupyflash bwd": lambda: cupyflash.flash_attn_backward(do, q, k, v, out, lse, causal=True),
            "torch drop-in fwd": lambda: cft.flash_attn_func(q, k, v, causal=True),
            "torch drop-in fwd+bwd": dropin_fwd_bwd,
            "  through the ops fwd": through_ops(lambda: cft.flash_attn_func(q, k, v, causal=True)),
            "  through the ops fwd+bwd": through_ops(dropin_fwd_bwd),
            "SDPA flash fwd": lambda: sdpa(qt, kt, vt, is_causal=True),
            "SDPA flash bwd": lambda: torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2), retain_graph=True),
            "SDPA flash fwd+bwd": lambda: torch.autograd.grad(sdpa(qt, kt, vt, is_causal=True), (qt, kt, vt),
                                                              do.transpose(1, 2)),
        }
        for name, fn in rows.items():
            print(f"{name:26s} {per_call_us(fn):7.1f} us/call")
    if "--profile" in sys.argv:
        for name in ("cupyflash fwd", "cupyflash bwd"):
            profile = cProfile.Profile()
            profile.runcall(lambda: [rows[name]() for _ in range(2000)])
            print(f"--- {name}")
            pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
