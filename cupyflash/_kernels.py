"""Kernel entry points: which template with which arguments, its name and its source text.

Every entry point is a one-line `extern "C"` wrapper around a template in cuda_src/, compiled
alone, so a process compiles only the variants it uses.
"""

import dataclasses
import itertools
from typing import Optional

from . import _config, _params, _sources

DTYPES = ("float16", "bfloat16")
ROW_KERNEL_ROWS, ROW_KERNEL_THREADS = 64, 256  # the backward's row kernels (RowKernel in sm80/bwd_schedule.cuh)

_HEADER = {"fwd": "sm80/fwd.cuh", "bwd": "sm80/bwd.cuh", "bwd_dot": "sm80/bwd.cuh", "bwd_convert_dq": "sm80/bwd.cuh"}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One entry point of the mma.sync kernels (cuda_src/sm80/); each flag is a template argument.

    The flag combinations that exist (all_kernels lists exactly these):
      fwd: plain, or options;
      bwd: plain (tile table 'bwd'), options, or options and deterministic (both 'bwd_options').
    A deterministic backward always runs the options kernels' tiles, so it is compiled as an
    options kernel (with every option off unless the call sets some): no deterministic kernel
    without options, and none for the forward, whose order of adds is fixed anyway.
    """
    pass_: str                               # 'fwd', 'bwd', 'bwd_dot' or 'bwd_convert_dq'
    dtype: str                               # 'float16' or 'bfloat16'
    tile: Optional[_config.Tile] = None      # fwd and bwd only
    local: bool = False                      # causal or sliding window: each row sees a bounded key range
    even_k: bool = False                     # caller's head dim == tile head dim: no column bounds
    options: bool = False                    # the score options and dropout (cuda_src/common/score.cuh)
    deterministic: bool = False              # bwd: dQ added in a fixed key-block order (requires options)

    def __post_init__(self):
        if self.deterministic and not (self.pass_ == "bwd" and self.options):
            raise ValueError("a deterministic kernel is a backward with options=True")

    @property
    def name(self):
        name = f"cupyflash_{self.pass_}_{self.dtype}"
        if self.tile is not None:
            t = self.tile
            name += f"_hd{t.headdim}_m{t.block_m}_n{t.block_n}_w{t.warps}_s{t.stages}"
            name += ("_local" * self.local + "_evenk" * self.even_k + "_options" * self.options
                     + "_deterministic" * self.deterministic)
        return name

    @property
    def threads(self):
        return self.tile.threads if self.tile is not None else ROW_KERNEL_THREADS

    @property
    def smem_bytes(self):
        return self.tile.smem_bytes(self.pass_) if self.tile is not None else 0

    def source(self):
        bf16 = _bool(self.dtype == "bfloat16")
        if self.tile is None:
            call = f"flash_{self.pass_}<{bf16}>(p);"
            check = (f"static_assert(RowKernel::kRows == {ROW_KERNEL_ROWS} && RowKernel::kThreads == {ROW_KERNEL_THREADS}, "
                     f"\"row kernel blocks differ from cupyflash/_kernels.py\");\n")
        else:
            t = self.tile
            args = f"{t.headdim}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}"
            flags = [self.local, self.even_k, self.options] + [self.deterministic] * (self.pass_ == "bwd")
            flags = ", ".join(_bool(f) for f in flags)
            call = f"flash_{self.pass_}<{args}, {bf16}, {flags}>(p);"
            traits = "FwdTile" if self.pass_ == "fwd" else "BwdTile"
            check = (f"static_assert({traits}<{args}>::kSmemBytes == {self.smem_bytes}, "
                     f"\"shared memory size differs from cupyflash/_config.py\");\n")
        return (_sources.translation_unit(_HEADER[self.pass_]) + "\n"
                + _params.size_assert() + "\n" + check
                + f'extern "C" __global__ void __launch_bounds__({self.threads}, 1) '
                + f"{self.name}(const __grid_constant__ FlashParams p) {{ {call} }}\n")


def _bool(flag):
    return "true" if flag else "false"


def all_kernels(families=_config.FAMILIES):
    """Every kernel variant of these families' tile tables (the combinations of Kernel's docstring)."""
    kernels = [Kernel(pass_, dtype) for pass_ in ("bwd_dot", "bwd_convert_dq") for dtype in DTYPES]
    flags_of_table = {"fwd": ((False, False), (True, False)), "bwd": ((False, False),),
                      "bwd_options": ((True, False), (True, True))}  # (options, deterministic)
    for (table, tile), dtype, local, even_k in itertools.product(
            _config.all_tiles(families), DTYPES, (False, True), (False, True)):
        for options, deterministic in flags_of_table[table]:
            kernels.append(Kernel(_config.kernel_pass(table), dtype, tile, local, even_k, options, deterministic))
    return kernels


def compile_jobs():
    """(arch, kernel) of every variant `check --compile` and the CI compile tests build (_config.COMPILE_CHECKS)."""
    return [(arch, kernel) for arch, families in _config.COMPILE_CHECKS[_config.MMA_SYNC].items()
            for kernel in all_kernels(families)]


def representative_jobs(jobs):
    """The variants of `jobs` that a default `check` and the test suite compile without a GPU: a
    cold run stays under half a minute on two cores, where the full sweep (`check --compile`, and
    the tests with CUPYFLASH_COMPILE_ALL=1, as CI runs them) takes minutes.

    They cover every code path the sweep does, once: on the newest arch (which builds every table),
    one variant per tile of its own family's tables, so every head dim and block shape of each pass,
    with the heaviest flags (local masking, column bounds, the options); every flag of one forward
    tile; the other dtype once; the row kernels; and one variant per table for each older arch.
    (What a user of a CPU-only machine runs is the NumPy reference: no kernel would be theirs.)"""
    primary = max((arch for arch, _ in jobs), key=int)

    def table(k):
        return "bwd_options" if k.pass_ == "bwd" and k.options else k.pass_

    def native(arch, k):
        family = _config.TILES[_config.MMA_SYNC].get(f"sm{arch}")
        return family is not None and k.tile == _config.Tile(k.tile.headdim, *family[table(k)][k.tile.headdim])

    def heaviest_flags(k):
        # (a backward with options: the deterministic one, whose code holds the other's)
        return k.local and not k.even_k and (k.options or k.pass_ != "fwd") and (k.deterministic or not (
            k.pass_ == "bwd" and k.options))

    def keep(arch, k):
        if k.tile is None:
            return arch == primary
        if not native(arch, k):
            return False
        first_dtype = k.dtype == DTYPES[0]
        if arch != primary:
            return first_dtype and heaviest_flags(k) and k.tile.headdim == 128
        sweep = k.pass_ == "fwd" and k.tile.headdim == 128
        return (first_dtype and (heaviest_flags(k) or sweep)) or (sweep and heaviest_flags(k))

    return [(arch, k) for arch, k in jobs if keep(arch, k)]
