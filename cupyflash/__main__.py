"""Command line: `python -m cupyflash info`, `python -m cupyflash check` and `python -m cupyflash bench`."""

import argparse
import itertools
import os
import platform
import sys
import time

import numpy

from . import __version__, _check, _compile, _config, _kernels, reference
from ._arrays import gpu_available
from ._check import Case


def _progress(done, total, label, start):
    """A one-line progress bar on a terminal; silent when stderr is a file or pipe."""
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {time.time() - start:5.1f}s {label:<60.60}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _table(headers, rows):
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    lines = [" | ".join(str(h).ljust(w) for h, w in zip(headers, widths)),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- info

def info():
    import cupy
    from cupy.cuda import nvrtc
    print(f"cupyflash {__version__}  cupy {cupy.__version__}  numpy {numpy.__version__}  "
          f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))}  python {platform.python_version()}")
    print(f"kernel cache: {_compile.cache_dir()}")
    if not gpu_available():
        print("GPU: none visible to CuPy (the NumPy reference still runs; see `check`)")
        return 0
    from .interface import _device_info
    device, cc, smem_limit = _device_info(cupy.cuda.Device().id)
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    family = _config.forced_family() or _config.family_of(cc)
    print(f"GPU {device.id}: {props['name'].decode()}  compute capability {cc[0]}.{cc[1]}  "
          f"{device.attributes['MultiProcessorCount']} SMs  shared memory {smem_limit // 1024} KiB/block (opt-in)  "
          f"L2 {device.attributes['L2CacheSize'] // 2 ** 20} MiB")
    print(f"tile table: {family}{' (forced by CUPYFLASH_TILES)' if _config.forced_family() else ''}")
    rows = []
    for hd in _config.HEADDIMS:
        row = [hd]
        for table in _config.TABLES:
            t = _config.tile_for(table, hd, cc, smem_limit)
            row.append(f"{t.block_m}x{t.block_n}, {t.warps} warps, {t.stages} stage(s), {t.smem_bytes(table) // 1024} KiB")
        rows.append(row)
    print(_table(["head dim", "fwd tile", "bwd tile", "bwd tile with options"], rows))
    return 0


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
    start, results = time.time(), []
    for i, case in enumerate(cases):
        _progress(i, len(cases), str(case), start)
        results.append(_check.run_gpu_case(case, seed=i))
    _progress(len(cases), len(cases), "", start)
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
    from .interface import flash_attn_backward, flash_attn_func
    cases = [Case(sq, sk, d, "float16", causal, nheads=4, nheads_k=hk)
             for (sq, sk), d, causal, hk in itertools.product([(1, 17), (113, 70), (70, 113)], (40, 128),
                                                             (False, True), (4, 1))]
    options = [dict(window=(9, 3)), dict(softcap=1.5), dict(alibi=True), dict(bias="heads"), dict(dropout_p=0.2),
               dict(window=(20, -1), softcap=2.0, alibi=True, bias="full", dropout_p=0.1)]
    cases += [Case(70, 113, 40, "float16", True, nheads=4, nheads_k=2, **o) for o in options]
    failures = 0
    start = time.time()
    for i, case in enumerate(cases):
        _progress(i, len(cases), str(case), start)
        inputs = _check.random_inputs(case, i)
        inputs.update({n: inputs[n].astype(numpy.float64) for n in ("q", "k", "v", "dout")})
        q, k, v, dout = (inputs[n] for n in ("q", "k", "v", "dout"))
        kwargs = _check.options_of(case, inputs)
        out, lse = flash_attn_func(q, k, v, causal=case.causal, return_lse=True, **kwargs)
        grads = flash_attn_backward(dout, q, k, v, out, lse, causal=case.causal, **kwargs)
        tiled_out, tiled_lse = reference.attention_forward_tiled(q, k, v, causal=case.causal, block_m=32, block_n=32,
                                                                 **kwargs)
        tiled_grads = reference.attention_backward_tiled(dout, q, k, v, tiled_out, tiled_lse, causal=case.causal,
                                                         **kwargs)
        for got, want in zip((out, *grads), (tiled_out, *tiled_grads)):
            if not numpy.allclose(got, want, rtol=1e-12, atol=1e-12):
                failures += 1
                print(f"\nFAIL numpy path {case}")
                break
    _progress(len(cases), len(cases), "", start)
    print(f"NumPy path: {len(cases) - failures} passed, {failures} failed")
    return failures


def _check_compile(verbose):
    start = time.time()
    results = _compile.compile_all(_kernels.compile_jobs(),
                                   progress=lambda done, total, label: _progress(done, total, label, start))
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


def check(verbose=False):
    if gpu_available():
        return _check_gpu()
    print("No GPU visible to CuPy: checking the NumPy path and compiling every kernel variant with NVRTC.")
    status = _check_numpy()
    status |= _check_compile(verbose)
    return 1 if status else 0


# ---------------------------------------------------------------------------------------- bench

def bench(args):
    if not gpu_available():
        print("bench needs a GPU visible to CuPy")
        return 1
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy and torch
    from . import benchmark
    impls = args.impls or list(benchmark.IMPLEMENTATIONS)
    status = 0
    if args.options_only:
        print(benchmark.write_options(benchmark.run_options(), args.out))
        return status
    if not args.memory_only:
        rows = benchmark.run_speed(args.headdims, args.seqlens, args.dtypes, impls=impls)
        print(benchmark.write_speed(rows, args.out, impls))
        print(benchmark.write_options(benchmark.run_options(), args.out))
    if not args.no_memory:
        print(benchmark.write_memory(benchmark.run_memory(args.memory_seqlens), args.out))
    print(f"results written to {args.out}")
    return status


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cupyflash", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="device, tile table, cache, versions")
    check_parser = commands.add_parser("check", help="correctness grid against the float64 reference "
                                                     "(without a GPU: NumPy path and NVRTC compile of every kernel)")
    check_parser.add_argument("--compile", action="store_true", help="also compile every kernel variant (GPU or not)")
    check_parser.add_argument("--verbose", action="store_true", help="list every kernel's ptxas report")
    bench_parser = commands.add_parser("bench", help="speed and memory beside the peers on this machine")
    bench_parser.add_argument("--out", default="bench/results", help="folder for the CSV, markdown and PNG files")
    bench_parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128, 256])
    bench_parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    bench_parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    bench_parser.add_argument("--impls", nargs="+", help="implementations to time (default: all)")
    bench_parser.add_argument("--memory-seqlens", type=int, nargs="+",
                              default=[1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072])
    bench_parser.add_argument("--no-memory", action="store_true", help="skip the memory table")
    bench_parser.add_argument("--memory-only", action="store_true", help="only the memory table")
    bench_parser.add_argument("--options-only", action="store_true",
                              help="only the attention options' table (window, softcap, ALiBi, bias, dropout, ...)")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "bench":
        return bench(args)
    status = check(args.verbose)
    if args.compile and gpu_available():
        status |= _check_compile(args.verbose)
    return status


if __name__ == "__main__":
    sys.exit(main())
