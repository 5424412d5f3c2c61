"""A/B timing of whole versions of cupyflash (package, tile tables and kernels) in one run.

    python bench/ab.py --compile TREE [TREE ...]   # beforehand, wherever NVRTC is: fill the kernel cache
    python bench/ab.py TREE [TREE ...]             # on the GPU machine, with the same CUPYFLASH_CACHE_DIR
    python bench/ab.py --options '{"dropout_p": 0.1, "seed": 1}' TREE ...   # calls with options
    python bench/ab.py --options '{"alibi_slopes": "random"}' TREE ...       # slopes drawn per cell
    python bench/ab.py --options '{"attn_bias": "random"}' TREE ...          # a (b, h, s, s) bias per cell
    python bench/ab.py --options '{"attn_bias": "padding"}' TREE ...         # a (b, 1, 1, s) one (a key mask's)
    python bench/ab.py --options '{"attn_bias": "padding_float32"}' TREE ... # the same in float32 ("random_float32" too)
    python bench/ab.py --pass bwd --options '{"attn_bias": "random", "return_dbias": true}' TREE ...  # with dbias
    python bench/ab.py --pass decode TREE ...    # flash_attn_with_kvcache steps, TB/s of K and V read
    python bench/ab.py --pass decode --decode-step append TREE ...   # each step appends a token first

A TREE is a directory holding one version's cupyflash/ and cuda_src/ (for a commit:
`mkdir DIR && git archive REV cupyflash cuda_src | tar -x -C DIR`), or `.` for this checkout. Each
version runs in a process of its own, so it brings its own launch code and tile tables; the
versions take turns for --rounds rounds (every other round in reverse order) and a cell is the
median of its rounds, each round printed below. The same tree given twice shows the run's noise:
up to 5% in a cell on the H200 (8% on an H100 in v92), so smaller differences need more rounds or
more runs. Cells are TFLOP/s (FLOPs as in ../shared/peers/README.md) at 16384 tokens (or
a cell's fourth field) and hidden 2048; each timing spans 10 calls back to back between CUDA events
(the host's time per call stays hidden), median of 7. Decode cells are batch:cache:nheads:nheads_k:hd:layout (layout dense or
pagedN, N-row pages in a random order), the cache full, one query row, bf16; each timing is a
replay of a CUDA graph of 20 steps (as a serving loop runs them: no host time between steps),
median of 15, in TB/s of K and V read; `--decode-step append` gives each step a new token (k and v,
the last cache row), `between` queues another kernel after each step.
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
# Decode cells of 256 MB or more of K and V (the smaller ones' steps last a few microseconds).
DECODE_CELLS = ["128:1024:32:8:128:dense", "128:1024:32:32:128:dense", "64:4096:32:8:128:dense",
                "16:16384:32:8:128:dense", "1:131072:32:8:128:dense", "8:131072:32:8:128:dense",
                "128:16384:32:8:64:dense", "1:131072:32:8:64:dense", "128:1024:32:8:128:paged16",
                "16:16384:32:8:128:paged16", "1:131072:32:8:64:paged16", "8:131072:32:8:128:paged256"]


def parse_cell(text):
    """'hd:seqlen:causal[:tokens]' -> (head dim, seqlen, causal, batch): batch x seqlen = tokens (16384
    unless given: fewer make the short calls whose grids end in a partial wave)."""
    fields = text.split(":")
    hd, seqlen, causal = fields[:3]
    tokens = int(fields[3]) if len(fields) == 4 else TOKENS
    if len(fields) > 4 or causal not in ("0", "1") or tokens % int(seqlen) or HIDDEN % int(hd):
        raise ValueError(f"a cell is hd:seqlen:causal[:tokens] with seqlen dividing tokens ({TOKENS} unless "
                         f"given), hd dividing {HIDDEN} and causal 0 or 1, got {text!r}")
    return int(hd), int(seqlen), causal == "1", tokens // int(seqlen)


def parse_decode_cell(text):
    """'batch:cache:nheads:nheads_k:hd:layout' -> (batch, cache, nheads, nheads_k, hd, page size or 0)."""
    fields = text.split(":")
    try:
        batch, cache, nheads, nheads_k, hd = map(int, fields[:5])
        layout = fields[5]
        page = 0 if layout == "dense" else int(layout.removeprefix("paged")) if layout.startswith("paged") else -1
        ok = len(fields) == 6 and min(batch, cache, nheads_k) > 0 and nheads % nheads_k == 0 and hd in (64, 128) and (
            page == 0 or (page > 0 and page % 16 == 0 and cache % page == 0))
    except (ValueError, IndexError):
        ok = False
    if not ok:
        raise ValueError(f"a decode cell is batch:cache:nheads:nheads_k:hd:layout with hd 64 or 128, nheads a "
                         f"multiple of nheads_k and layout dense or pagedN (N a multiple of 16 dividing the "
                         f"cache), got {text!r}")
    return batch, cache, nheads, nheads_k, hd, page


def compile_jobs(pass_, dtype, given):
    """(arch, kernel) of this process's cupyflash that the H200 runs for `pass_` at `dtype`, plain and
    causal: the forward's wgmma kernels where the version has them, else its sm_90 mma.sync ones,
    with the features of the options `given` (with a bias, the version's 'fwd_bias' tiles where it
    has them; where its kernels have bias tiles, those and their tiles for a 16-bit bias alone); the
    backward's with options, its wgmma 'bwd_options' tiles where it has them (the mma.sync ones
    compile on the GPU machine, in the untimed first calls); for decode the KV
    cache's kernels (not causal)."""
    import dataclasses
    from cupyflash import _config, _kernels, options
    jobs = [(arch, k) for arch, k in _kernels.compile_jobs()
            if arch.startswith("90") and k.dtype == dtype and not k.options]
    named = [options.by_name(name).kernels for name in given if name != "return_dbias"]
    features = tuple(f for f in _kernels.FEATURES if f in named)
    if pass_ == "decode":
        return [(arch, k) for arch, k in jobs if k.pass_ in _kernels.KVCACHE_PASSES and not k.local]
    wgmma_tables = _config.TILES.get(_config.WGMMA, {}).get("sm90", {})
    # (a 16-bit bias comes in tiles where the version's kernels have them, a float32 one does not)
    has_bias_tiles = any(field.name == "bias_tiles" for field in dataclasses.fields(_kernels.Kernel))
    tiles = "bias" in features and has_bias_tiles and not str(given.get("attn_bias")).endswith("_float32")
    own_table = "bwd_options" if pass_ == "bwd" else (
        "fwd_bias" if "bias" in features and (tiles or not has_bias_tiles) else None)
    if features and own_table in wgmma_tables:  # (a version's tiles for these options' calls alone)
        kernels = [_kernels.Kernel(pass_, dtype, _config.Tile(hd, *entry, _config.WGMMA), local, False, features)
                   for hd, entry in wgmma_tables[own_table].items() for local in (False, True)]
        if tiles:
            kernels = [dataclasses.replace(k, bias_tiles=k.tile.fits_bias_tiles(pass_, features)) for k in kernels]
        return [("90a", k) for k in kernels]
    if pass_ == "fwd":
        wgmma = [(arch, k) for arch, k in jobs if k.pass_ == "fwd" and getattr(k, "wgmma", False)]
        return [(arch, dataclasses.replace(k, features=features))
                for arch, k in wgmma or [(arch, k) for arch, k in jobs if k.pass_ == "fwd"]]
    return [(arch, k) for arch, k in jobs if k.pass_ != "fwd" and k.pass_ not in _kernels.KVCACHE_PASSES]


def worker_compile(pass_, dtype, given):
    """Compiles compile_jobs(...); prints the count, those that spill and the cache files they are
    (bench/device_trees.py packs those)."""
    from cupyflash import _compile
    jobs = compile_jobs(pass_, dtype, given)
    reports = _compile.compile_all(jobs)
    unclean = [k.name for _, k, report in reports if not report.clean]
    files = [_compile.compile_kernel(k, arch)[0].name for arch, k in jobs]  # (compiled: the cache's paths)
    print(json.dumps({"kernels": len(jobs), "unclean": unclean, "files": files}))


def worker_time(pass_, dtype, cells, given):
    import cupy
    import numpy
    from cupyflash import flash_attn_backward, flash_attn_func
    from cupyflash._arrays import bfloat16_dtype
    element = bfloat16_dtype() if dtype == "bfloat16" else numpy.dtype(dtype)
    result = {}
    for text in cells:
        hd, seqlen, causal, batch = parse_cell(text)
        nheads = HIDDEN // hd
        q, k, v, dout = (cupy.random.standard_normal((batch, seqlen, nheads, hd), dtype=cupy.float32).astype(element)
                         for _ in range(4))
        options = dict(given)
        if options.get("alibi_slopes") == "random":  # (one slope per head, as the options table draws them)
            options["alibi_slopes"] = cupy.random.random_sample(nheads, dtype=cupy.float32) * 0.1
        bias_shape = {"random": (batch, nheads, seqlen, seqlen), "padding": (batch, 1, 1, seqlen)}
        form = str(options.get("attn_bias"))
        if form.removesuffix("_float32") in bias_shape:  # (of the inputs' dtype, as the options table's, or float32)
            options["attn_bias"] = cupy.random.standard_normal(bias_shape[form.removesuffix("_float32")],
                                                               dtype=cupy.float32)
            if not form.endswith("_float32"):
                options["attn_bias"] = options["attn_bias"].astype(element)
        backward_only = {name: options.pop(name) for name in ("return_dbias", "deterministic") if name in options}
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, **options)
        call = ((lambda: flash_attn_func(q, k, v, causal=causal, **options)) if pass_ == "fwd"
                else (lambda: flash_attn_backward(dout, q, k, v, out, lse, causal=causal, **options, **backward_only)))
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


def decode_inputs(batch, cache, nheads, nheads_k, hd, page, seqlen_q=1):
    """(q, k_cache, v_cache, block_table or None, cache_seqlens) of a full bf16 cache, drawn on the
    current stream; pages (page > 0) in a random order."""
    import cupy
    import numpy
    from cupyflash._arrays import bfloat16_dtype
    draw = lambda *shape: cupy.random.standard_normal(shape, dtype=cupy.float32).astype(bfloat16_dtype())  # noqa: E731
    rows = (batch * cache // page, page) if page else (batch, cache)
    table = (cupy.asarray(numpy.random.default_rng(cache).permutation(batch * cache // page), cupy.int32)
             .reshape(batch, cache // page) if page else None)
    return (draw(batch, seqlen_q, nheads, hd), draw(*rows, nheads_k, hd), draw(*rows, nheads_k, hd), table,
            cupy.full((batch,), cache, cupy.int32))


def graph_step_ms(step, stream, steps=20, replays=15):
    """Median ms per step of `step` captured `steps` times in a CUDA graph on `stream` (no host time
    between steps, as a serving loop runs them), over `replays` replays."""
    import cupy
    step()
    stream.synchronize()
    stream.begin_capture()
    for _ in range(steps):
        step()
    graph = stream.end_capture()
    graph.launch(stream)
    times = []
    for _ in range(replays):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / steps)
    return statistics.median(times)


# What a timed decode step is: the attention alone, back to back (as the decode grid times it);
# with one new token appended first (a serving loop's call: k and v given); or with another
# kernel queued between steps (a model's own kernels come between its attention calls).
DECODE_STEPS = ("bare", "append", "between")


def worker_decode(cells, kind="bare"):
    import cupy
    from cupyflash import flash_attn_with_kvcache
    result = {}
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        other = cupy.zeros(1024, cupy.float32)
        for text in cells:
            batch, cache, nheads, nheads_k, hd, page = parse_decode_cell(text)
            q, k_cache, v_cache, table, lengths = decode_inputs(batch, cache, nheads, nheads_k, hd, page)
            new = {}
            if kind == "append":  # the new token fills the cache's last row
                lengths -= 1
                new = dict(k=q[:, :, :nheads_k].copy(), v=q[:, :, :nheads_k].copy())
            stream.synchronize()

            def step():
                flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, **new)
                if kind == "between":
                    cupy.add(other, 1, out=other)
            result[text] = 2 * batch * cache * nheads_k * hd * 2 / graph_step_ms(step, stream) / 1e9
            del q, k_cache, v_cache, table, new
    print(json.dumps(result))


def run_tree(tree, mode, args):
    """Runs this script's worker `mode` with `tree`'s cupyflash; returns its JSON result or None."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, __file__, mode, "--pass", args.pass_, "--dtype", args.dtype,
               "--cells", ",".join(args.cells), "--options", json.dumps(args.options), "--decode-step", args.decode_step]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        print(f"{tree}: {mode} failed\n{done.stderr[-2000:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", type=pathlib.Path)
    parser.add_argument("--compile", action="store_true", help="only fill the kernel cache (no GPU needed)")
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "decode"), default="fwd")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--cells", type=lambda s: s.split(","), default=None,
                        help="hd:seqlen:causal[:tokens],... (default: hd 64/128/256, 1k/4k/16k, causal and not); "
                             "for decode batch:cache:nheads:nheads_k:hd:layout,... (default: DECODE_CELLS)")
    parser.add_argument("--options", type=json.loads, default={},
                        help='keyword options of every call, as JSON (e.g. \'{"softcap": 30.0}\')')
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-step", choices=DECODE_STEPS, default="bare",
                        help="decode: the attention alone, with a new token appended, or with a kernel between steps")
    parser.add_argument("--worker-compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-time", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    decode = args.pass_ == "decode"
    if args.cells is None:
        args.cells = DECODE_CELLS if decode else ALL_CELLS
    for cell in args.cells:
        (parse_decode_cell if decode else parse_cell)(cell)
    if args.worker_compile:
        return worker_compile(args.pass_, args.dtype, args.options)
    if args.worker_time:
        return worker_decode(args.cells, args.decode_step) if decode else worker_time(args.pass_, args.dtype, args.cells, args.options)
    trees = [tree.resolve() for tree in args.trees]
    for tree in trees:
        if not (tree / "cupyflash").is_dir() or not (tree / "cuda_src").is_dir():
            parser.error(f"{tree} holds no cupyflash/ and cuda_src/")
    if args.compile:
        for tree in trees:
            result = run_tree(tree, "--worker-compile", args)
            print(tree, result and {key: value for key, value in result.items() if key != "files"}, flush=True)
        return
    results = {}  # (cell, column) -> [TFLOP/s per round]
    columns = [f"{i}:{tree.name}" for i, tree in enumerate(trees)]
    for round_ in range(args.rounds):  # odd rounds in reverse order, so no version always runs first
        order = list(zip(columns, trees))
        for column, tree in order[::-1] if round_ % 2 else order:
            for cell, value in (run_tree(tree, "--worker-time", args) or {}).items():
                results.setdefault((cell, column), []).append(value)
    if decode:
        print(f"decode bfloat16 TB/s of K and V ({args.decode_step} steps), median of {args.rounds} rounds")
    else:
        print(f"{args.pass_} {args.dtype} {json.dumps(args.options)} TFLOP/s, median of {args.rounds} rounds")
    width = 30 if decode else 24
    print(f"{'cell (b:cache:h:hk:hd:layout)' if decode else 'cell (hd:seqlen:causal)':{width}}"
          + "".join(f"{column:>16}" for column in columns))
    for cell in args.cells:
        values = [results.get((cell, column)) for column in columns]
        print(f"{cell:{width}}" + "".join(f"{statistics.median(v):16.{3 if decode else 1}f}" if v else f"{'-':>16}"
                                          for v in values))
    print("each round (as run; the spread is the noise a difference must exceed)")
    for cell in args.cells:
        for column in columns:
            values = results.get((cell, column), [])
            print(f"{cell:{width}}{column:>16}  " + " ".join(f"{v:.{3 if decode else 1}f}" for v in values))


if __name__ == "__main__":
    main(sys.argv[1:])
