"""Where the options table's varlen row (1.16-1.21x the plain forward, 1.11-1.15x the backward,
equal lengths) loses its time: the same call timed plain, varlen as a user calls it (cu_seqlens
read on the host, which waits for the GPU), varlen under no_host_sync (kernels alone), and varlen
replayed from a CUDA graph, in one run, shuffled rounds (benchmark.median_ms).

Usage (GPU): PYTHONPATH=. python bench/varlen_cost.py [--seqlens 4096 16384] [--headdims 128]
"""
import argparse

import torch

import cupyflash
from cupyflash import benchmark


def cells(seqlen, headdim):
    batch, nheads = 16384 // seqlen, 2048 // headdim
    g = torch.Generator(device="cuda").manual_seed(seqlen + headdim)
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, device="cuda", dtype=torch.int32)
    packed = [x.reshape(batch * seqlen, nheads, headdim) for x in (q, k, v, dout)]
    out, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True)
    vout, vlse = cupyflash.flash_attn_varlen_func(*packed[:3], cu, cu, seqlen, seqlen, return_lse=True)

    def varlen_fwd():
        return cupyflash.flash_attn_varlen_func(*packed[:3], cu, cu, seqlen, seqlen)

    def varlen_bwd():
        return cupyflash.flash_attn_varlen_backward(packed[3], *packed[:3], vout, vlse, cu, cu, seqlen, seqlen)

    def unsynced(fn):
        def call():
            with cupyflash.no_host_sync():
                return fn()
        return call
    calls = {
        "plain fwd": lambda: cupyflash.flash_attn_func(q, k, v),
        "varlen fwd": varlen_fwd,
        "varlen fwd, no_host_sync": unsynced(varlen_fwd),
        "plain bwd": lambda: cupyflash.flash_attn_backward(dout, q, k, v, out, lse),
        "varlen bwd": varlen_bwd,
        "varlen bwd, no_host_sync": unsynced(varlen_bwd),
    }
    timers = {name: benchmark.BatchTimer(fn) for name, fn in calls.items()}
    timers["varlen fwd, graph"] = benchmark.GraphTimer(unsynced(varlen_fwd))
    timers["varlen bwd, graph"] = benchmark.GraphTimer(unsynced(varlen_bwd))
    return timers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--headdims", type=int, nargs="+", default=[128])
    args = parser.parse_args()
    for headdim in args.headdims:
        for seqlen in args.seqlens:
            ms = benchmark.median_ms(cells(seqlen, headdim), reps=9)
            print(f"hd{headdim} seqlen {seqlen}:")
            for name in ms:
                plain = ms["plain fwd" if "fwd" in name else "plain bwd"]
                print(f"  {name:28s} {ms[name]:8.3f} ms  {ms[name] / plain:5.2f}x plain")


if __name__ == "__main__":
    main()
