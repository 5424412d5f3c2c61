"""A/B timing of kernel source versions in one process: cuda_src/ against other copies of it.

    python bench/ab.py OLD_DIR [OLD_DIR ...]            # on the GPU machine
    python bench/ab.py --compile OLD_DIR [OLD_DIR ...]  # beforehand, anywhere: fill the compile cache

Each OLD_DIR holds the cuda_src/ tree of another version (e.g. `git archive REV cuda_src | tar -x
-C OLD --strip-components=1`). The versions take turns (ROUNDS rounds) and each cell is the best round, so a
slow spell of the machine hurts both alike. The versions must share params.cuh's FlashParams
(the launch code is the current one), and `_config.Tile.smem_bytes`: a version whose tiles take
other shared-memory sizes needs it swapped in `use` while that version runs (each kernel checks
it at compile time). Prints TFLOP/s non-causal/causal, bf16, 16k tokens, hidden
2048 (FLOPs as in ../shared/peers/README.md). Edit CASES and SEQLENS for the question at hand.
"""

import itertools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench/tiles.py

from cupyflash import _compile, _config, _kernels, _plan, _sources

CASES = [("fwd", 128, (128, 32, 4, 1)), ("bwd", 64, (128, 128, 8, 2)), ("bwd", 128, (64, 128, 8, 2)),
         ("bwd", 256, (64, 64, 8, 1))]  # (pass, head dim, tile)
SEQLENS = (1024, 4096)
ROUNDS = 2  # each cell is the best of this many turns of every version
_current_source_dir = _sources._source_dir


def use(source_dir):
    """Makes every later compile and launch use the sources in `source_dir` (None: cuda_src/)."""
    _sources._source_dir = _current_source_dir if source_dir is None else (lambda: source_dir)
    _sources.read.cache_clear()
    _compile._loaded.clear()
    _plan._plans.clear()


def compile_cases(versions):
    """Compiles every case's bf16 kernels of every version into the cache (one process, in turn)."""
    for name, source_dir in versions.items():
        use(source_dir)
        kernels = [_kernels.Kernel(pass_, "bfloat16", _config.Tile(hd, *tile), local, True)
                   for (pass_, hd, tile), local in itertools.product(CASES, (False, True))]
        kernels += [_kernels.Kernel(pass_, "bfloat16") for pass_ in ("bwd_dot", "bwd_convert_dq")]
        for kernel in kernels:
            _compile.compile_kernel(kernel, "90")
        print(name, "compiled")


def time_cases(versions):
    from tiles import inputs, tflops
    table = _config.TILES[_config.MMA_SYNC]["sm90"]
    print(f"{'case':30} {'seqlen':>6} " + " ".join(f"{name:>15}" for name in versions))
    for (pass_, hd, tile), seqlen in itertools.product(CASES, SEQLENS):
        tensors = inputs(seqlen, hd)
        table[pass_][hd] = tile
        best = {}
        for _round, (name, source_dir) in itertools.product(range(ROUNDS), versions.items()):
            use(source_dir)
            for causal in (False, True):
                best[name, causal] = max(best.get((name, causal), 0.0), tflops(pass_, tensors, causal))
        cells = " ".join(f"{best[name, False]:7.1f}/{best[name, True]:<7.1f}" for name in versions)
        print(f"{pass_} hd{hd} {str(tile):22} {seqlen:6d} {cells}", flush=True)


def main(args):
    compile_only = "--compile" in args
    old_dirs = [pathlib.Path(a).resolve() for a in args if a != "--compile"]
    versions = {"cuda_src": None, **{d.name: d for d in old_dirs}}
    (compile_cases if compile_only else time_cases)(versions)


if __name__ == "__main__":
    main(sys.argv[1:])
