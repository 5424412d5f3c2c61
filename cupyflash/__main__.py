"""Command line: `python -m cupyflash info`, `python -m cupyflash check` and `python -m cupyflash bench`."""

import argparse
import itertools
import os
import platform
import shutil
import sys
import time

import numpy

from . import __version__, _check, _compile, _config, _kernels, benchmark, options, reference
from ._arrays import SetupError, missing_cupy, missing_gpu, missing_nvrtc
from ._check import Case


class _Progress:
    """Progress of a long loop on stderr: a redrawn bar on a terminal; in a log (CI, a pipe), a line
    at each further tenth of the work (at most one per 3 seconds, so short loops stay quiet), at
    least one every 30 seconds, and one at the end."""

    def __init__(self, total, what):
        self.total, self.what, self.start = total, what, time.time()
        self.tty = sys.stderr.isatty()
        self.logged_tenth, self.logged_at = 0, self.start

    def __call__(self, done, label=""):
        now = time.time()
        elapsed = now - self.start
        if self.tty:
            width = 30
            filled = width * done // max(self.total, 1)
            line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {self.what} {elapsed:5.1f}s {label}"
            columns = shutil.get_terminal_size().columns - 1  # a wrapped line would not be redrawn in place
            sys.stderr.write(f"\r{line[:columns]:<{columns}}")
            if done == self.total:
                sys.stderr.write("\n")
        else:
            tenth = 10 * done // max(self.total, 1)
            since = now - self.logged_at
            if done == self.total or since >= 30 or (tenth > self.logged_tenth and since >= 3):
                sys.stderr.write(f"  {done}/{self.total} {self.what} ({elapsed:.0f}s)\n")
                self.logged_tenth, self.logged_at = tenth, now
        sys.stderr.flush()


def _table(headers, rows):
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    lines = [" | ".join(str(h).ljust(w) for h, w in zip(headers, widths)),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- info

def _versions():
    """One line of versions; CuPy and NVRTC read 'missing' where they are."""
    parts = [f"cupyflash {__version__}", f"python {platform.python_version()}", f"numpy {numpy.__version__}"]
    if missing_cupy():
        parts.append("cupy missing")
    else:
        import cupy
        parts.append(f"cupy {cupy.__version__}")
        nvrtc = "missing" if missing_nvrtc() else ".".join(map(str, _compile.nvrtc_version()))
        parts.append(f"NVRTC {nvrtc}")
    return "  ".join(parts)


def _tile_text(tile, table):
    family = f"wgmma hd{tile.headdim}: " if tile.kernel_family == _config.WGMMA else ""
    ring = table == "fwd_bias"  # (its kernels' ring of bias tiles)
    return (f"{family}{tile.block_m}x{tile.block_n}, {tile.warps} warps, {tile.stages} stage(s), "
            f"{tile.smem_bytes(table, ('bias',) * ring, ring) // 1024} KiB")


# A column per tile table (_config.TABLES; a table without its header here is a KeyError).
_TABLE_HEADERS = {"fwd": "fwd tile", "bwd": "bwd tile", "bwd_options": "bwd tile with options",
                  "bwd_deterministic": "deterministic bwd tile",
                  "bwd_light": "bwd tile with softcap, ALiBi or dropout alone",
                  "decode": "decode tile",
                  "decode_small": f"decode tile of pages under {_config.DENSE_TILE_PAGE} rows, caches of "
                                  f"{_config.SHORT_CACHE} or fewer",
                  "decode_few": "decode tile of calls of at most a CTA per SM"}
_TILE_HEADERS = ["head dim", *(_TABLE_HEADERS[table] for table in _config.TABLES)]


def _table_tile(table, headdim):
    """A tile table's tile for a caller's head dim (the table's next head dim up)."""
    padded = _config.padded_headdim(headdim, tuple(table))
    return _config.Tile(padded, *table[padded])


def info():
    print(_versions())
    count, size = _compile.cache_usage()
    cache = _compile.cache_dir()
    print(f"kernel cache: {cache} ({count} files, {size / 2 ** 20:.1f} MB; CUPYFLASH_CACHE_DIR moves it; "
          f"clear it with: rm -rf {cache})")
    forced = _config.forced_family()
    hint = missing_gpu()
    nvrtc_hint = missing_nvrtc()
    if nvrtc_hint and nvrtc_hint != hint:
        print(nvrtc_hint)
    if hint:
        print(hint)
        families = [forced] if forced else list(_config.FAMILIES)
        for family in families:
            tables = _config.TILES[_config.MMA_SYNC][family]
            rows = [[hd, *(_tile_text(_table_tile(tables[table], hd), table) for table in _config.TABLES)]
                    for hd in _config.HEADDIMS]
            print(f"\ntile table {family}{' (forced by CUPYFLASH_TILES)' if forced else ''}:")
            print(_table(_TILE_HEADERS, rows))
            _print_wgmma_tables(family)
        return 0
    import cupy
    from ._schedule import device_info
    device, cc, smem_limit = device_info(cupy.cuda.Device().id)
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    family = forced or _config.family_of(cc)
    print(f"GPU {device.id}: {props['name'].decode()}  compute capability {cc[0]}.{cc[1]}  "
          f"{device.attributes['MultiProcessorCount']} SMs  shared memory {smem_limit // 1024} KiB/block (opt-in)  "
          f"L2 {device.attributes['L2CacheSize'] // 2 ** 20} MiB")
    print(f"tile table: {family}{' (forced by CUPYFLASH_TILES)' if forced else ''}; kernel family per pass: "
          + ", ".join(f"{table} {_config.kernel_family_for(table, cc)}"
                      + (f" up to head dim {max(_config.TILES[_config.WGMMA]['sm90'][table])}"
                         if _config.kernel_family_for(table, cc) == _config.WGMMA else "")
                      for table in _config.TABLES)
          + (" (forced by CUPYFLASH_FAMILY)" if _config.forced_kernel_family() else ""))
    rows = [[hd, *(_tile_text(_config.tile_for(table, hd, cc, smem_limit,
                                               kernel_family=_config.kernel_family_for(table, cc, hd)), table)
                   for table in _config.TABLES)]
            for hd in _config.HEADDIMS]
    print(_table(_TILE_HEADERS, rows))
    if any(_config.kernel_family_for(table, cc) == _config.WGMMA for table in _config.TABLES):
        _print_wgmma_tables(family)  # with the forward's tables by length and masking, which the columns omit
    return 0


def _print_wgmma_tables(family):
    """The wgmma family's tables: each pass's, then the forward's by length and masking (forward_table)."""
    instead = {"fwd_bias": "its calls with a 16-bit attn_bias of aligned rows take (bias tiles in a ring beside K's)",
               "fwd_short": f"its calls of at most {_config.SHORT_SEQLEN} query rows take",
               "fwd_options": "its longer calls with ALiBi or dropout (no other option) take",
               "fwd_local": "its causal or windowed calls take",
               "bwd_options": "its calls with score options take",
               "bwd_full": "its calls without score options, causal or window edges or varlen take"}
    printed = []
    for table, wgmma in _config.TILES[_config.WGMMA].get(family, {}).items():
        if any(wgmma is other for other in printed):
            continue  # (another's: the deterministic backward's is the plain table, the light options' the options')
        printed.append(wgmma)
        tiles = "; ".join(_tile_text(_config.Tile(hd, *cfg, _config.WGMMA), table) for hd, cfg in wgmma.items())
        if table in instead:
            print(f"  {instead[table]}: {tiles}")
        else:
            print(f"on compute capability 9.0 the {_config.kernel_pass(table)} pass up to head dim {max(wgmma)} is "
                  f"wgmma's (every option): {tiles}")


# ---------------------------------------------------------------------------------------- check

def gpu_cases():
    """The correctness grid: dtypes x head dims x lengths x causal, half of it with GQA."""
    lengths = [(1, 17), (17, 1), (113, 113), (1000, 257), (257, 1000)]
    return [Case(sq, sk, d, dtype, causal, nheads=4, nheads_k=2 if gqa else 4)
            for dtype, d, (sq, sk), causal in itertools.product(("float16", "bfloat16"), (40, 64, 128, 256),
                                                                lengths, (False, True))
            for gqa in [(sq + d) % 2 == 1]]


def _check_gpu():
    cases = gpu_cases()
    progress, results = _Progress(len(cases), "cases"), []
    for i, case in enumerate(cases):
        results.append(_check.run_gpu_case(case, seed=i))
        progress(i + 1, str(case))
    rows = []
    for (dtype, hd), group in itertools.groupby(results, key=lambda r: (r.case.dtype, r.case.headdim)):
        group = list(group)
        worst = max(c.error / c.bound if c.bound else (0 if c.error == 0 else numpy.inf)
                    for r in group for c in r.checks)
        passed = sum(r.ok for r in group)
        rows.append([dtype, hd, f"{passed}/{len(group)}", f"{worst:.2f}"])
    print(_table(["dtype", "head dim", "passed", "worst error / bound"], rows))
    failures = [r for r in results if not r.ok]
    for r in failures[:10]:
        print(f"FAIL {r.case}: {r.describe()}")
    print(f"{len(results) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


def _check_numpy():
    """The NumPy path of the public API against the tiled reference (to 1e-12), plain and with options."""
    from .api import flash_attn_backward, flash_attn_func
    cases = [Case(sq, sk, d, "float16", causal, nheads=4, nheads_k=hk)
             for (sq, sk), d, causal, hk in itertools.product([(1, 17), (113, 70), (70, 113)], (40, 59, 128),
                                                             (False, True), (4, 1))]
    # Every option (options.settings: one case each, and one with all of them).
    cases += [Case(70, 113, 40, "float16", True, nheads=4, nheads_k=2, **spec) for spec in options.settings().values()]
    failures = 0
    progress = _Progress(len(cases), "NumPy cases")
    for i, case in enumerate(cases):
        inputs = _check.random_inputs(case, i)
        inputs.update({n: inputs[n].astype(numpy.float64) for n in ("q", "k", "v", "dout")})
        q, k, v, dout = (inputs[n] for n in ("q", "k", "v", "dout"))
        every = _check.options_of(case, inputs)
        kwargs = {name: value for name, value in every.items() if options.by_name(name).reference}
        out, lse = flash_attn_func(q, k, v, causal=case.causal, return_lse=True, **_check.forward_options(case, inputs))
        grads = flash_attn_backward(dout, q, k, v, out, lse, causal=case.causal, **every)
        tiled_out, tiled_lse = reference.attention_forward_tiled(q, k, v, causal=case.causal, block_m=32, block_n=32,
                                                                 **kwargs)
        tiled_grads = reference.attention_backward_tiled(dout, q, k, v, tiled_out, tiled_lse, causal=case.causal,
                                                         **kwargs)
        for got, want in zip((out, *grads), (tiled_out, *tiled_grads)):
            if not numpy.allclose(got, want, rtol=1e-12, atol=1e-12):
                failures += 1
                print(f"\nFAIL numpy path {case}")
                break
        progress(i + 1, str(case))
    print(f"NumPy path: {len(cases) - failures} passed, {failures} failed")
    return failures


def _check_compile(jobs, verbose):
    progress = _Progress(len(jobs), "kernels compiled")
    results = _compile.compile_all(jobs, progress=lambda done, total, label: progress(done, label))
    rows = [[f"sm_{arch}", k.name, r.registers, "unknown" if r.spills is None else r.spills, r.stack_frame,
             k.smem_bytes] for arch, k, r in results if verbose or not r.clean]
    if rows:
        print(_table(["arch", "kernel", "registers", "spill bytes", "stack", "smem"], rows))
    unclean = [r for _, _, r in results if not r.clean]
    for arch in sorted({a for a, _, _ in results}):
        regs = [r.registers for a, _, r in results if a == arch]
        print(f"sm_{arch}: {len(regs)} kernel variants compiled, registers {min(regs)}-{max(regs)}, "
              f"{sum(1 for a, _, r in results if a == arch and not r.clean)} "
              f"with spills or a stack frame")
    return 1 if unclean else 0


def check(every_variant=False, verbose=False):
    hint = missing_gpu()
    if hint is None:
        status = _check_gpu()
        return status | _check_compile(_kernels.compile_jobs(), verbose) if every_variant else status
    every = _kernels.compile_jobs()
    jobs = every if every_variant else _kernels.representative_jobs(every)
    print(hint)
    print(f"Checking the NumPy path, then compiling {len(jobs)} kernel variants with NVRTC"
          f"{'' if every_variant else f' (a representative set; --compile builds all {len(every)})'}.")
    status = _check_numpy()
    nvrtc_hint = missing_nvrtc()
    if nvrtc_hint:
        print(f"cannot compile the kernels: {nvrtc_hint}")
        return 1
    status |= _check_compile(jobs, verbose)
    return 1 if status else 0


# ---------------------------------------------------------------------------------------- bench

def bench(args):
    hint = missing_gpu()
    if hint:
        print(f"bench times the kernels on a GPU: {hint}")
        return 1
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy and torch
    impls = args.impls or list(benchmark.IMPLEMENTATIONS)
    status = 0
    if args.host or args.profile:
        shapes = [benchmark.host_shape(s) for s in args.host_shapes]
        columns = [args.profile] if args.profile else list(benchmark.HOST_COLUMNS)
        cells = benchmark.run_host(shapes, args.host_calls, columns, profile=bool(args.profile))
        if not args.profile:  # a profile times one column: host.md keeps the last full table
            print(benchmark.write_host(cells, args.out, benchmark.host_environment(), args.host_calls))
        return status
    if args.decode:
        grid = dict(benchmark.DECODE_GRID, batches=args.decode_batches, caches=args.decode_caches)
        shapes = benchmark.decode_shapes(grid)
        copy_tbps = benchmark.measure_copy_tbps()
        cells = benchmark.run_decode(shapes)
        done = len({c.shape for c in cells})
        environment = benchmark.host_environment() + (
            "" if done == len(shapes) else f"; interrupted after {done} of {len(shapes)} cells")
        print(benchmark.write_decode(cells, args.out, environment, copy_tbps))
        return status if done == len(shapes) else 130
    if args.options_only:
        print(benchmark.write_options(benchmark.run_options(words=args.option_rows), args.out))
        return status
    if not args.memory_only:
        rows = benchmark.run_speed(args.headdims, args.seqlens, args.dtypes, impls=impls, passes=args.passes)
        print(benchmark.write_speed(rows, args.out, impls))
        cells = benchmark.speed_cells(args.headdims, args.seqlens, args.dtypes)
        if len({(r.dtype, r.headdim, r.seqlen, r.causal) for r in rows}) < len(cells):  # interrupted: no more tables
            print(f"results written to {args.out}")
            return 130
        print(benchmark.write_options(benchmark.run_options(), args.out))
    if not args.no_memory:
        print(benchmark.write_memory(benchmark.run_memory(args.memory_seqlens), args.out))
    print(f"results written to {args.out}")
    return status


def _parser():
    parser = argparse.ArgumentParser(prog="python -m cupyflash", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cupyflash {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, kernel cache, device and tile tables",
                        description="Versions, the kernel cache (folder, size, how to clear it), the GPU and the "
                                    "tile it gets for each head dim and pass; without a GPU, the tile tables "
                                    "(the one CUPYFLASH_TILES names, or all).")
    check_parser = commands.add_parser(
        "check", help="correctness against the float64 reference (without a GPU: NumPy path and NVRTC compiles)",
        description="With a GPU: the correctness grid against the float64 reference. Without one: the NumPy path "
                    "against the tiled reference, and an NVRTC compile of a representative set of kernel variants "
                    "with their ptxas reports. Exit code 1 on any failure or spill, 130 on Ctrl-C.")
    check_parser.add_argument("--compile", action="store_true",
                              help="compile every kernel variant (several minutes cold; the test suite does too)")
    check_parser.add_argument("--verbose", action="store_true", help="list every kernel's ptxas report")
    bench_parser = commands.add_parser(
        "bench", help="speed and memory beside the peers on this machine (needs a GPU)",
        description="Times cupyflash beside every attention implementation it finds, and writes CSV, markdown "
                    "and PNG files. --host times the host's work per call instead (host.md, host.csv).")
    bench_parser.add_argument("--out", default="bench/results",
                              help="folder for the CSV, markdown and PNG files (default: %(default)s)")
    bench_parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128, 256],
                              help="head dims of the speed table (default: %(default)s)")
    bench_parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384],
                              help="sequence lengths of the speed table (default: %(default)s)")
    bench_parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"],
                              help="dtypes of the speed table (default: %(default)s)")
    bench_parser.add_argument("--passes", nargs="+", choices=benchmark.PASSES, default=list(benchmark.PASSES),
                              help="passes of the speed table (default: %(default)s)")
    bench_parser.add_argument("--impls", nargs="+", metavar="IMPL",
                              help="implementations to time, of: " + ", ".join(map(repr, benchmark.IMPLEMENTATIONS))
                                   + " (default: all; one not installed gets blank cells)")
    bench_parser.add_argument("--memory-seqlens", type=int, nargs="+",
                              default=[1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072],
                              help="sequence lengths of the memory table (default: %(default)s)")
    bench_parser.add_argument("--no-memory", action="store_true", help="skip the memory table (default: off)")
    bench_parser.add_argument("--memory-only", action="store_true", help="only the memory table (default: off)")
    bench_parser.add_argument("--options-only", action="store_true",
                              help="only the attention options' table (each option beside the plain kernel and a peer) "
                                   "(default: off)")
    bench_parser.add_argument("--option-rows", nargs="+", metavar="WORD",
                              help="with --options-only: only the rows whose option names one of these words "
                                   "(e.g. dropout attn_bias), beside the plain row (default: every row)")
    bench_parser.add_argument("--host", action="store_true",
                              help="only the host-time table: microseconds per call of each way of calling "
                                   "cupyflash beside SDPA flash and JAX cuDNN, written to host.md and host.csv "
                                   "(default: off)")
    bench_parser.add_argument("--decode", action="store_true",
                              help="only the decode table: TB/s of the KV cache read per decode step beside SDPA "
                                   "flash and cuDNN, dense and paged caches, written to decode.md, decode.csv and "
                                   "decode.png (default: off)")
    bench_parser.add_argument("--decode-batches", type=_positive, nargs="+",
                              default=list(benchmark.DECODE_GRID["batches"]),
                              help="batches of the decode table (default: %(default)s)")
    bench_parser.add_argument("--decode-caches", type=_positive, nargs="+",
                              default=list(benchmark.DECODE_GRID["caches"]),
                              help="cache lengths of the decode table (default: %(default)s)")
    bench_parser.add_argument("--host-shapes", type=_host_shape, nargs="+", default=list(benchmark.HOST_SHAPES),
                              metavar="SHAPE",
                              help="shapes of the host table: " + ", ".join(
                                  f"{name} ({'x'.join(map(str, shape))})" for name, shape in
                                  benchmark.HOST_SHAPES.items()) + ", or BxSxHxD (default: %(default)s)")
    bench_parser.add_argument("--host-calls", type=_positive, default=benchmark.HOST_CALLS,
                              help=f"back-to-back calls per timed repetition of the host table (the median of "
                                   f"{benchmark.HOST_REPS} repetitions) (default: %(default)s)")
    bench_parser.add_argument("--profile", choices=list(benchmark.HOST_COLUMNS), metavar="COLUMN",
                              help="time only this column of the host table and print cProfile's top entries for "
                                   "its calls in each cell, writing no files; one of: "
                                   + ", ".join(map(repr, benchmark.HOST_COLUMNS)) + " (default: off)")
    return parser


def _positive(text):
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"a positive integer, got {text!r}")
    return int(text)


def _host_shape(spec):
    try:
        benchmark.host_shape(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return spec


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        _config.forced_family()  # a bad CUPYFLASH_TILES or _FAMILY stops every command, not only the first launch
        _config.forced_kernel_family()
    except ValueError as error:
        print(f"cupyflash: {error}", file=sys.stderr)
        return 2
    try:
        if args.command == "info":
            return info()
        if args.command == "bench":
            return bench(args)
        return check(args.compile, args.verbose)
    except SetupError as error:
        print(f"cupyflash: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncupyflash: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
