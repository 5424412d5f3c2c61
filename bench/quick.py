"""A quick timing of cupyflash beside PyTorch SDPA (flash backend), bf16, 16k tokens, FLOPs as the
FlashAttention papers count them: fwd 4 b h s^2 d (halved when causal), bwd 2.5x fwd.

Usage: python bench/quick.py [headdim ...]   (default: 128).
Timing: CUDA events around `calls` back-to-back calls (so the host's launch work overlaps the GPU's
and the kernels, not Python, are measured), per-call time = elapsed / calls; median of `reps` such
batches after warm-up. Peers are timed the same way in the same process.
"""

import sys

import numpy

import cupyflash


def time_ms(fn, reps=10, calls=10, warmup=3):
    """Median per-call milliseconds of `fn`, which must launch its work on the current stream of
    the framework it uses (torch's here: events are recorded on it)."""
    import torch
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    return float(numpy.median(times))


def main(headdims):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    print(f"{'hdim':>4} {'seqlen':>6} {'causal':>6} | {'fwd cupyflash':>13} {'fwd SDPA-flash':>14} | "
          f"{'bwd cupyflash':>13} {'bwd SDPA-flash':>14}  (TFLOP/s)")
    for hd in headdims:
        for seqlen in (1024, 4096, 16384):
            batch, nheads = 16384 // seqlen, 2048 // hd
            for causal in (False, True):
                flops = 4 * batch * nheads * seqlen ** 2 * hd / (2 if causal else 1)
                q, k, v, do = (torch.randn(batch, seqlen, nheads, hd, device="cuda", dtype=torch.bfloat16)
                               for _ in range(4))
                out, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
                ours_f = time_ms(lambda: cupyflash.flash_attn_func(q, k, v, causal=causal))
                ours_b = time_ms(lambda: cupyflash.flash_attn_backward(do, q, k, v, out, lse, causal=causal))
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    peer_f = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    peer_b = time_ms(lambda: torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2),
                                                                 retain_graph=True))
                tf = lambda ms, mult=1.0: mult * flops / ms / 1e9  # noqa: E731
                print(f"{hd:4d} {seqlen:6d} {str(causal):>6} | {tf(ours_f):13.1f} {tf(peer_f):14.1f} | "
                      f"{tf(ours_b, 2.5):13.1f} {tf(peer_b, 2.5):14.1f}", flush=True)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [128])
