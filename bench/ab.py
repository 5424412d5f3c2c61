"""A/B timing of whole versions of cupyflash (package, tile tables and kernels) in one run.

    python bench/ab.py --compile TREE [TREE ...]   # beforehand, wherever NVRTC is: fill the kernel cache
    python bench/ab.py TREE [TREE ...]             # on the GPU machine, with the same CUPYFLASH_CACHE_DIR
    python bench/ab.py --options '{"dropout_p": 0.1, "seed": 1}' TREE ...   # calls with options

A TREE is a directory holding one version's cupyflash/ and cuda_src/ (for a commit:
`mkdir DIR && git archive REV cupyflash cuda_src | tar -x -C DIR`), or `.` for this checkout. Each
version runs in a process of its own, so it brings its own launch code and tile tables; the
versions take turns for --rounds rounds and a cell is the median of its rounds. The same tree given
twice shows the run's noise: up to 5% in a cell on the H200, so smaller differences need more
rounds or more runs. Cells are TFLOP/s (FLOPs as in ../shared/peers/README.md) at 16384 tokens and
hidden 2048; each timing spans 10 calls back to back between CUDA events (the host's time per call
stays hidden), median of 7.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

TOKENS, HIDDEN = 16384, 2048
ALL_CELLS = [f"{hd}:{seqlen}:{causal}" for hd in (64, 128, 256) for seqlen in (1024, 4096, 16384) for causal in (0, 1)]


def parse_cell(text):
    """'hd:seqlen:causal' -> (head dim, seqlen, causal)."""
    hd, seqlen, causal = text.split(":")
    if causal not in ("0", "1") or TOKENS % int(seqlen) or HIDDEN % int(hd):
        raise ValueError(f"a cell is hd:seqlen:causal with seqlen dividing {TOKENS}, hd dividing {HIDDEN} and "
                         f"causal 0 or 1, got {text!r}")
    return int(hd), int(seqlen), causal == "1"


def compile_jobs(pass_, dtype):
    """(arch, kernel) of this process's cupyflash that the H200 runs for `pass_` at `dtype`, plain and
    causal: the forward's wgmma kernels where the version has them, else its sm_90 mma.sync ones.
    (With --options, the options' kernels compile on the GPU machine, in the untimed first calls.)"""
    from cupyflash import _kernels
    jobs = [(arch, k) for arch, k in _kernels.compile_jobs()
            if arch.startswith("90") and k.dtype == dtype and not k.options]
    if pass_ == "fwd":
        wgmma = [(arch, k) for arch, k in jobs if k.pass_ == "fwd" and getattr(k, "wgmma", False)]
        return wgmma or [(arch, k) for arch, k in jobs if k.pass_ == "fwd"]
    return [(arch, k) for arch, k in jobs if k.pass_ != "fwd"]


def worker_compile(pass_, dtype):
    from cupyflash import _compile
    jobs = compile_jobs(pass_, dtype)
    reports = _compile.compile_all(jobs)
    unclean = [k.name for _, k, report in reports if not report.clean]
    print(json.dumps({"kernels": len(jobs), "unclean": unclean}))


def worker_time(pass_, dtype, cells, given):
    import cupy
    import numpy
    from cupyflash import flash_attn_backward, flash_attn_func
    from cupyflash._arrays import bfloat16_dtype
    element = bfloat16_dtype() if dtype == "bfloat16" else numpy.dtype(dtype)
    result = {}
    for text in cells:
        hd, seqlen, causal = parse_cell(text)
        batch, nheads = TOKENS // seqlen, HIDDEN // hd
        q, k, v, dout = (cupy.random.standard_normal((batch, seqlen, nheads, hd), dtype=cupy.float32).astype(element)
                         for _ in range(4))
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, **given)
        call = ((lambda: flash_attn_func(q, k, v, causal=causal, **given)) if pass_ == "fwd"
                else (lambda: flash_attn_backward(dout, q, k, v, out, lse, causal=causal, **given)))
        for _ in range(3):
            call()
        start, end, times = cupy.cuda.Event(), cupy.cuda.Event(), []
        for _ in range(7):
            start.record()
            for _ in range(10):
                call()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 10)
        flops = 4 * batch * nheads * seqlen * seqlen * hd / (2 if causal else 1) * (2.5 if pass_ == "bwd" else 1)
        result[text] = flops / statistics.median(times) / 1e9
    print(json.dumps(result))


def run_tree(tree, mode, args):
    """Runs this script's worker `mode` with `tree`'s cupyflash; returns its JSON result or None."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, __file__, mode, "--pass", args.pass_, "--dtype", args.dtype,
               "--cells", ",".join(args.cells), "--options", json.dumps(args.options)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        print(f"{tree}: {mode} failed\n{done.stderr[-2000:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", type=pathlib.Path)
    parser.add_argument("--compile", action="store_true", help="only fill the kernel cache (no GPU needed)")
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--cells", type=lambda s: s.split(","), default=ALL_CELLS,
                        help="hd:seqlen:causal,... (default: hd 64/128/256, 1k/4k/16k, causal and not)")
    parser.add_argument("--options", type=json.loads, default={},
                        help='keyword options of every call, as JSON (e.g. \'{"softcap": 30.0}\')')
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker-compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-time", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for cell in args.cells:
        parse_cell(cell)
    if args.worker_compile:
        return worker_compile(args.pass_, args.dtype)
    if args.worker_time:
        return worker_time(args.pass_, args.dtype, args.cells, args.options)
    trees = [tree.resolve() for tree in args.trees]
    for tree in trees:
        if not (tree / "cupyflash").is_dir() or not (tree / "cuda_src").is_dir():
            parser.error(f"{tree} holds no cupyflash/ and cuda_src/")
    if args.compile:
        for tree in trees:
            print(tree, run_tree(tree, "--worker-compile", args), flush=True)
        return
    results = {}  # (cell, column) -> [TFLOP/s per round]
    columns = [f"{i}:{tree.name}" for i, tree in enumerate(trees)]
    for _ in range(args.rounds):
        for column, tree in zip(columns, trees):
            for cell, value in (run_tree(tree, "--worker-time", args) or {}).items():
                results.setdefault((cell, column), []).append(value)
    print(f"{args.pass_} {args.dtype} {json.dumps(args.options)} TFLOP/s, median of {args.rounds} rounds")
    print(f"{'cell (hd:seqlen:causal)':24}" + "".join(f"{column:>16}" for column in columns))
    for cell in args.cells:
        values = [results.get((cell, column)) for column in columns]
        print(f"{cell:24}" + "".join(f"{statistics.median(v):16.1f}" if v else f"{'-':>16}" for v in values))


if __name__ == "__main__":
    main(sys.argv[1:])
