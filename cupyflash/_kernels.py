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

_HEADER = {"fwd": "sm80/fwd.cuh", "bwd": "sm80/bwd.cuh", "bwd_dot": "sm80/bwd.cuh", "bwd_convert_dq": "sm80/bwd.cuh",
           "decode": "sm80/decode.cuh", "decode_combine": "sm80/decode.cuh", "kvcache_append": "sm80/decode.cuh"}
ROW_KERNELS = ("bwd_dot", "bwd_convert_dq", "decode_combine", "kvcache_append")  # no tile: ROW_KERNEL_THREADS each
KVCACHE_PASSES = ("decode", "decode_combine", "kvcache_append")  # flash_attn_with_kvcache's (cuda_src/sm80/decode.cuh)
# The score options a kernel can be compiled for, in order: the names of their bits in
# cuda_src/common/score.cuh (namespace feature), and the `kernels` of their cupyflash.options entries.
FEATURES = ("softcap", "alibi", "bias", "dropout")
DECODE_FEATURES = ("softcap", "alibi")  # flash_attn_with_kvcache's
# The wgmma kernels' (cuda_src/sm90/): header, tile traits, template, tensor maps, by pass.
_WGMMA = {"fwd": ("sm90/fwd.cuh", "Sm90FwdTile", "flash_fwd_sm90", "FwdMaps"),
          "bwd": ("sm90/bwd.cuh", "Sm90BwdTile", "flash_bwd_sm90", "BwdMaps")}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel entry point; each flag is a template argument. Its tile's kernel family says whose:
    the mma.sync kernels (cuda_src/sm80/) or the wgmma ones (cuda_src/sm90/: the forward and the
    backward; never even_k, as TMA zero-fills the columns past the head dim).

    `features` are the score options compiled in (a subsequence of FEATURES; DECODE_FEATURES for
    decode): a call runs the kernel of exactly the options it uses, compiled on first use, so an
    option costs only its own code (where that kernel spills, the one with every feature instead:
    _compile.spill_free). A backward with features runs the tile table 'bwd_options' (the light
    ones 'bwd_light'), a deterministic one without 'bwd_deterministic' (backward_table); the forward has no
    deterministic kernel, its order of adds being fixed anyway.
    all_kernels lists the variants the compile checks build: each table's plain kernel and its
    kernel with every feature, the heaviest code, which holds every subset's.
    """
    pass_: str                               # 'fwd', 'bwd', 'decode' or a row kernel (ROW_KERNELS)
    dtype: str                               # 'float16' or 'bfloat16'
    tile: Optional[_config.Tile] = None      # fwd, bwd and decode only
    local: bool = False                      # causal or sliding window: each row sees a bounded key range
    even_k: bool = False                     # caller's head dim == tile head dim: no column bounds
    features: tuple = ()                     # the score options compiled in (FEATURES, in order)
    deterministic: bool = False              # bwd: dQ added in a fixed key-block order
    bias_tiles: bool = False                 # wgmma: the attn_bias comes by TMA into a ring of tiles (Tile.fits_bias_tiles)
    kv_heads: bool = False                   # decode: a tile of several kv heads (_kvcache.decode_heads)

    def __post_init__(self):
        allowed = DECODE_FEATURES if self.pass_ == "decode" else FEATURES if self.tile is not None else ()
        if tuple(f for f in allowed if f in self.features) != tuple(self.features):
            raise ValueError(f"a {self.pass_} kernel's features are a subsequence of {allowed}, not {self.features}")
        if self.deterministic and self.pass_ != "bwd":
            raise ValueError("a deterministic kernel is a backward")
        if self.wgmma and (self.pass_ not in _WGMMA or self.even_k):
            raise ValueError("the wgmma kernels are forwards and backwards, without even_k")
        if self.kv_heads and not (self.pass_ == "decode" and self.tile.decode_copy_rows > 1):
            raise ValueError(f"a decode tile of several kv heads copies several rows a step, not {self.tile}")
        if self.bias_tiles and not (self.wgmma and self.tile.fits_bias_tiles(self.pass_, self.features, self.local)):
            raise ValueError(f"no ring of bias tiles fits a {self.pass_} kernel with {self.features} on {self.tile}")

    @property
    def options(self):
        """Whether any score option is compiled in."""
        return bool(self.features)

    def with_every_feature(self):
        """The same kernel with every feature its pass can take, where it has any (_compile.spill_free;
        with bias tiles, every feature that leaves them room: ring_features)."""
        if not self.features:
            return self
        if self.pass_ == "decode":
            return dataclasses.replace(self, features=DECODE_FEATURES)
        return dataclasses.replace(self, features=ring_features(self.tile, self.pass_) if self.bias_tiles else FEATURES)

    @property
    def wgmma(self):
        return self.tile is not None and self.tile.kernel_family == _config.WGMMA

    def arch(self, compute_capability):
        """The target it is compiled for on a device of this compute capability ("90" -> "90a")."""
        return compute_capability + "a" if self.wgmma else compute_capability

    @property
    def name(self):
        name = f"cupyflash_{self.pass_}_{self.dtype}"
        if self.wgmma:
            t = self.tile
            return (name + f"_wgmma_hd{t.headdim}_m{t.block_m}_n{t.block_n}_s{t.stages}"
                    + "_local" * self.local + self._suffix())
        if self.tile is not None:
            t = self.tile
            name += f"_hd{t.headdim}_m{t.block_m}_n{t.block_n}_w{t.warps}_s{t.stages}"
            name += "_local" * self.local + "_evenk" * self.even_k + self._suffix()
        return name

    def _suffix(self):
        return ("".join("_" + f for f in self.features) + "_tiles" * self.bias_tiles
                + "_deterministic" * self.deterministic + "_kvheads" * self.kv_heads)

    def _features_argument(self):
        return " | ".join(f"feature::{f}" for f in self.features) or "0"

    @property
    def threads(self):
        return self.tile.threads if self.tile is not None else ROW_KERNEL_THREADS

    @property
    def smem_bytes(self):
        return (self.tile.smem_bytes(self.pass_, self.features, self.bias_tiles, self.local) if self.tile is not None
                else 0)

    def source(self):
        bf16 = _bool(self.dtype == "bfloat16")
        if self.wgmma:
            t = self.tile
            header, traits, template, maps = _WGMMA[self.pass_]
            args = (f"{t.headdim}, {t.block_n}, {t.stages}, {t.block_m // 64}" if self.pass_ == "fwd"
                    else f"{t.headdim}, {t.block_m}, {t.block_n}, {t.stages}")
            flags = ([_bool(self.local), self._features_argument()] + [_bool(self.deterministic)] * (self.pass_ == "bwd")
                     + [_bool(self.bias_tiles)])
            flags = ", ".join(flags)
            tile_traits = (f"{traits}<{args}, {_bool(self.local)}, {_bool(self.bias_tiles)}, {self._features_argument()}>"
                           if self.pass_ == "fwd"
                           else f"{traits}<{args}, {_bool(self.bias_tiles)}, {_bool('dropout' in self.features)}>")
            return (_sources.translation_unit(header) + "\n" + _params.size_assert() + "\n"
                    + f"static_assert({tile_traits}::kSmemBytes == {self.smem_bytes} && "
                    + f"{tile_traits}::kThreads == {self.threads}"
                    + (f" && {tile_traits}::kTileSlots == "
                       f"{_bool(t.takes_tiles_from_counter(self.local))}" if self.pass_ == "fwd" else "") + ", "
                    + '"the wgmma tile differs from cupyflash/_config.py");\n'
                    + f'extern "C" __global__ void __launch_bounds__({self.threads}, 1) {self.name}('
                    + f"const __grid_constant__ FlashParams p, const __grid_constant__ {maps} maps) "
                    + f"{{ {template}<{args}, {bf16}, {flags}>(p, maps); }}\n")
        if self.tile is None:
            call = f"flash_{self.pass_}<{bf16}>(p);"
            check = "" if not self.pass_.startswith("bwd") else (
                f"static_assert(RowKernel::kRows == {ROW_KERNEL_ROWS} && RowKernel::kThreads == {ROW_KERNEL_THREADS}, "
                f"\"row kernel blocks differ from cupyflash/_kernels.py\");\n")
        elif self.pass_ == "decode":
            t = self.tile
            args = f"{t.headdim}, {t.block_n}, {t.warps}, {t.stages}"
            call = (f"flash_decode<{args}, {bf16}, {_bool(self.local)}, {self._features_argument()}, "
                    f"{_bool(self.kv_heads)}>(p);")
            check = (f"static_assert(DecodeTile<{args}>::kSmemBytes == {self.smem_bytes} && "
                     f"DecodeTile<{args}>::kRows == {t.block_m}, \"the decode tile differs from cupyflash/_config.py\");\n")
        else:
            t = self.tile
            args = f"{t.headdim}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}"
            flags = ([_bool(self.local), _bool(self.even_k), self._features_argument()]
                     + [_bool(self.deterministic)] * (self.pass_ == "bwd"))
            flags = ", ".join(flags)
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


# The light options: a backward with one of these alone, not deterministic, runs the plain kernels'
# passes in the mma.sync family (cuda_src/sm80/bwd.cuh) on the 'bwd_light' tiles.
LIGHT_FEATURES = (("softcap",), ("alibi",), ("dropout",))


def backward_table(features, deterministic):
    """The tile table a backward runs: 'bwd_light' for LIGHT_FEATURES, else 'bwd_options' where it
    compiles in score options (their code needs the registers), else 'bwd_deterministic' where it
    is deterministic, else 'bwd'."""
    if features:
        return "bwd_light" if tuple(features) in LIGHT_FEATURES and not deterministic else "bwd_options"
    return "bwd_deterministic" if deterministic else "bwd"


# The (features, deterministic) pairs the compile checks build per tile table (or its pass): the plain kernel and
# the one with every feature (a call's own subset compiles on first use); and, for the hd128 tiles
# (first dtype, LOCAL), each feature alone. 'fwd_bias' kernels have bias tiles, and a wgmma
# backward's bias kernels a twin with them (ring_features).
_CHECKED_FLAGS = {"fwd": (((), False), (FEATURES, False)), "bwd": (((), False),),
                  "bwd_options": ((FEATURES, False), (FEATURES, True)), "bwd_deterministic": (((), True),),
                  "bwd_light": tuple((features, False) for features in LIGHT_FEATURES),
                  "bwd_full": (((), False), ((), True)), "fwd_bias": ((("bias",), False), (FEATURES, False)),
                  "decode": (((), False), (DECODE_FEATURES, False)),
                  "decode_small": (((), False), (DECODE_FEATURES, False)),
                  "decode_few": (((), False), (DECODE_FEATURES, False))}
_SINGLE_FLAGS = {table: tuple(((f,), False) for f in FEATURES) for table in ("fwd", "fwd_local", "bwd_options")}
# Softcap alone: bfloat16 forwards then subtract a fixed maximum (cuda_src/common/score.cuh,
# score_bound), code that the kernel with every feature does not hold.
_BOUNDED_FLAGS = {"fwd": ((("softcap",), False),)}


def all_kernels(families=_config.FAMILIES, kernel_family=_config.MMA_SYNC):
    """The kernel variants the compile checks build for these GPU families' tile tables of a kernel
    family (_CHECKED_FLAGS, _SINGLE_FLAGS, _BOUNDED_FLAGS; the row kernels with the mma.sync family; never even_k for
    wgmma or decode; a wgmma forward table's tile only where _config.forward_table gives it; each
    decode kernel's twin of several kv heads where its tile copies several rows a step)."""
    wgmma = kernel_family == _config.WGMMA
    kernels = [] if wgmma else [Kernel(pass_, dtype) for pass_ in ROW_KERNELS for dtype in DTYPES]
    for (table, tile), dtype, local, even_k in itertools.product(
            _config.all_tiles(families, kernel_family), DTYPES, (False, True), (False, True)):
        if even_k and (wgmma or _config.kernel_pass(table) == "decode"):
            continue
        if local and table == "bwd_full":
            continue  # (its tile serves no causal or window edge: sm90/bwd.cuh asserts it)
        if wgmma and _config.kernel_pass(table) == "fwd" and table not in (
                _config.forward_table(tile.headdim, seqlen_q, local, bias, features)
                for seqlen_q in (1, _config.SHORT_SEQLEN + 1) for bias in (False, True)
                for features in ((), ("alibi",))):
            continue  # no call runs it (a LOCAL one of a head dim with a 'fwd_local' tile, say)
        flags = _CHECKED_FLAGS.get(table) or _CHECKED_FLAGS[_config.kernel_pass(table)]
        if tile.headdim == 128 and dtype == DTYPES[0] and local and not even_k:
            flags += _SINGLE_FLAGS.get(table, ())
        if dtype == "bfloat16":
            flags += _BOUNDED_FLAGS.get(_config.kernel_pass(table), ())
        pass_ = _config.kernel_pass(table)
        for features, deterministic in flags:
            if table == "fwd_bias" and "bias" not in features:
                continue  # (its tile serves the forwards with bias tiles alone)
            kernel = Kernel(pass_, dtype, tile, local, even_k, features, deterministic, table == "fwd_bias")
            kernels.append(kernel)
            if pass_ == "decode" and tile.decode_copy_rows > 1:
                kernels.append(dataclasses.replace(kernel, kv_heads=True))
            if wgmma and pass_ == "bwd" and "bias" in features:
                twin = tuple(f for f in features if f in ring_features(tile, pass_))
                if tile.fits_bias_tiles(pass_, twin):
                    kernels.append(dataclasses.replace(kernel, features=twin, bias_tiles=True))
    return list(dict.fromkeys(kernels))  # (a tile in two tables of one pass is one kernel)


def ring_features(tile, pass_):
    """The most features a wgmma kernel with bias tiles on `tile` can have: every one, or all but
    dropout where its words leave the ring no room (Tile.fits_bias_tiles)."""
    return FEATURES if tile.fits_bias_tiles(pass_, FEATURES) else tuple(f for f in FEATURES if f != "dropout")


def compile_jobs():
    """(arch, kernel) of every variant `check --compile` and the CI compile tests build (_config.COMPILE_CHECKS)."""
    return [(arch, kernel) for kernel_family, archs in _config.COMPILE_CHECKS.items()
            for arch, families in archs.items() for kernel in all_kernels(families, kernel_family)]


def representative_jobs(jobs):
    """The variants of `jobs` that a default `check` and the test suite compile without a GPU: a
    cold run stays under half a minute on two cores, where the full sweep (`check --compile`, and
    the tests with CUPYFLASH_COMPILE_ALL=1, as CI runs them) takes minutes.

    They cover every code path the sweep does, once (a kernel with one feature runs a subset of the
    code of the one with every feature): the wgmma kernels' tiles with their heaviest
    flags and every flag at hd128; on the mma.sync arch that builds every table,
    one variant per tile of its own family's tables, so every head dim and block shape of each pass,
    with the heaviest flags (local masking, column bounds, the options); every flag of one forward
    tile; the other dtype once; the row kernels; one variant per table for each other arch; and
    the KV cache's kernels once each (every decode tile with its heaviest flags, and one twin of
    several kv heads); and softcap alone at hd128 in bfloat16 (_BOUNDED_FLAGS), once per family.
    (What a user of a CPU-only machine runs is the NumPy reference: no kernel would be theirs.)"""
    primary = next(arch for arch, families in _config.COMPILE_CHECKS[_config.MMA_SYNC].items()
                   if families == _config.FAMILIES)

    def tables(k):
        if k.pass_ == "bwd":
            return (backward_table(k.features, k.deterministic),)
        return tuple(t for t in _config.TABLES if _config.kernel_pass(t) == k.pass_)

    def native(arch, k):
        family = _config.TILES[_config.MMA_SYNC].get(f"sm{arch}")
        return family is not None and any(
            k.tile.headdim in family[t] and k.tile == _config.Tile(k.tile.headdim, *family[t][k.tile.headdim])
            for t in tables(k))

    def heaviest_flags(k):
        # (a backward with options: the deterministic one, whose code holds the other's; but the
        # light options', compiled without)
        return k.local and not k.even_k and (k.options or k.pass_ != "fwd") and (k.deterministic or not (
            k.pass_ == "bwd" and k.options and k.features not in LIGHT_FEATURES))

    def own_deterministic_tile(arch, k):
        # a 'bwd_deterministic' tile that is not the plain backward's (where the plain one spills)
        plain = _config.TILES[_config.MMA_SYNC].get(f"sm{arch}", {}).get("bwd", {}).get(k.tile.headdim)
        return not k.wgmma and plain is not None and k.tile != _config.Tile(k.tile.headdim, *plain)

    def keep(arch, k):
        if k.pass_ == "fwd" and k.features == ("softcap",) and k.dtype == "bfloat16":  # (_BOUNDED_FLAGS' code)
            return k.tile.headdim == 128 and k.local and not k.even_k and (k.wgmma or (arch == primary
                                                                                      and native(arch, k)))
        heaviest_features = k.features in ((), FEATURES, DECODE_FEATURES) or (
            k.bias_tiles and k.features == ring_features(k.tile, k.pass_)) or (
            k.pass_ == "bwd" and k.features in LIGHT_FEATURES)  # (their own code)
        if not heaviest_features or (k.deterministic and not k.features and not own_deterministic_tile(arch, k)):
            return False  # (the sweep's single features: their code is the full set's, less)
        if k.wgmma:  # every tile with the heaviest flags, and every flag at hd128
            return k.dtype == DTYPES[0] and ((k.local and k.options and (k.deterministic or k.pass_ == "fwd"))
                                             or k.tile.headdim == 128)
        if k.pass_ in KVCACHE_PASSES:  # the KV cache's kernels: every tile with the heaviest flags, one dtype
            # (of the twins of several kv heads one: a 32-key tile's, whose blocks hold two runs)
            return arch == primary and k.dtype == DTYPES[0] and (k.tile is None or (
                k.local and k.options and native(arch, k) and (not k.kv_heads or k.tile.block_n == 32)))
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
