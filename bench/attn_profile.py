"""One forward or backward call of each implementation of the speed grid, for ncu: a cell's inputs
built as `bench` builds them (batch x seqlen = 16384 tokens, hidden 2048), each call run a few
times outside the profiled range (compilation, autotuning), then once between cudaProfilerStart
and Stop, so that `ncu --profile-from-start off` measures exactly that call's kernels. Prints, in
order, the implementation and cell each profiled range belongs to.

Usage (GPU):
    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python bench/attn_profile.py [--impl NAME ...] PASS:HD:SEQLEN[:causal] ...
e.g. fwd:64:1024:causal bwd:128:4096. The default implementations are cupyflash and SDPA cuDNN.
"""
import argparse
import sys


def parse_cell(text):
    pass_, hd, seqlen, *rest = text.split(":")
    if pass_ not in ("fwd", "bwd") or rest not in ([], ["causal"]):
        raise argparse.ArgumentTypeError(f"a cell is PASS:HD:SEQLEN[:causal], got {text!r}")
    return pass_, int(hd), int(seqlen), rest == ["causal"]


def main(argv=None):
    from cupyflash import benchmark
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", action="append", choices=list(benchmark.IMPLEMENTATIONS),
                        help="an implementation to profile (repeatable; default: cupyflash and SDPA cuDNN)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--tokens", type=int, default=benchmark.TOKENS, help="batch x seqlen")
    parser.add_argument("--device", default="cuda", help="another device only runs the plumbing (the CPU test)")
    parser.add_argument("cells", type=parse_cell, nargs="+", help="PASS:HD:SEQLEN[:causal]")
    args = parser.parse_args(argv)
    import torch
    for pass_, hd, seqlen, causal in args.cells:
        batch, nheads = max(1, args.tokens // seqlen), benchmark.HIDDEN // hd
        q, k, v, dout = (torch.randn(batch, seqlen, nheads, hd, device=args.device, dtype=getattr(torch, args.dtype))
                         for _ in range(4))
        for impl in args.impl or ["cupyflash", "SDPA cuDNN"]:
            call, _ = benchmark.IMPLEMENTATIONS[impl](q, k, v, dout, causal).timed[pass_]
            for _ in range(3):
                call()
            print(f"profiled: {pass_} hd{hd} s{seqlen}{' causal' if causal else ''} {impl}", flush=True)
            benchmark.run_profiled(call, args.device)


if __name__ == "__main__":
    main(sys.argv[1:])
