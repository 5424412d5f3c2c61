"""One decode step of each implementation of `bench --decode`, for ncu: the cells' inputs built as
the decode table builds them, every step run (and checked against cupyflash's) outside the
profiled range, then each implementation's step once between cudaProfilerStart and Stop, so that
`ncu --profile-from-start off` measures exactly those kernels. Prints, in order, the
implementation each profiled range belongs to.

Usage (GPU):
    ncu --profile-from-start off --clock-control none --csv --metrics METRICS \\
        python bench/decode_profile.py [--impl NAME ...] B:CACHE:H:HK:HD:LAYOUT ...
METRICS (bench/notes/v52): whether a step's SMs stay busy to its end (sm__cycles_active avg
against max), its DRAM bytes and rate, and its instructions.
"""
import argparse
import os
import sys

METRICS = ",".join((
    "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__cycles_active.avg", "sm__cycles_active.max", "sm__cycles_active.min", "launch__grid_size",
    "launch__block_size", "smsp__inst_executed.sum", "lts__t_sector_hit_rate.pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active"))


def main(argv=None):
    from ab import parse_decode_cell
    from cupyflash import benchmark
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", action="append", choices=list(benchmark.DECODE_IMPLEMENTATIONS),
                        help="an implementation to profile (repeatable; default: each, cupyflash first)")
    parser.add_argument("--seqlen-q", type=int, default=1)
    parser.add_argument("--device", default="cuda", help="another device only runs the plumbing (the CPU test)")
    parser.add_argument("cells", type=parse_decode_cell, nargs="+", help="batch:cache:nheads:nheads_k:hd:layout")
    args = parser.parse_args(argv)
    impls = args.impl or list(benchmark.DECODE_IMPLEMENTATIONS)
    for batch, cache, nheads, nheads_k, headdim, page in args.cells:
        shape = benchmark.DecodeShape(batch, cache, nheads, nheads_k, headdim, args.seqlen_q,
                                      f"paged{page}" if page else "dense")
        generator, q, k, v = benchmark.decode_inputs(shape, args.device)
        steps, expected = {}, None
        for impl in impls:
            step = benchmark.DECODE_IMPLEMENTATIONS[impl](shape, q, k, v, generator)
            for _ in range(3):
                out = step()
            if expected is None:
                expected = out
            elif not benchmark._agrees(out, expected):
                raise SystemExit(f"{impl} disagrees with {impls[0]} at {shape}")
            steps[impl] = step
        for impl, step in steps.items():
            print(f"profiled: {benchmark._decode_label(shape)} {impl}", flush=True)
            benchmark.run_profiled(step, args.device)
        del q, k, v, steps, expected


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))  # ab.py
    main()
