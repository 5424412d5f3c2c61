"""Tile sizes: one table per GPU family, chosen at run time from the device's attributes.

The kernels are templates over (head dim, block_m, block_n, warps, stages). A caller's head dim is rounded
up to the next head dim of the table (the extra columns are zero-filled and never written).
Setting CUPYFLASH_TILES=sm80|sm86|sm90 forces a family's table on any GPU, so every table is
tested on whatever card the tests run on.
"""

import dataclasses
import os

HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEADDIM = HEADDIMS[-1]

# (block_m, block_n, warps, stages) per family, pass and head dim. `stages` is the number of buffers
# for the tiles a CTA streams through (bwd: Q, dO, lse, D; fwd: K and V).
# Shared memory per CTA (row = row_bytes(hd), cuda_src/sm80/tile.cuh):
#   fwd: (block_m + 2 block_n stages) row                                        (Q, K, V)
#   bwd: 2 block_n row + stages (2 block_m row + 8 block_m) + 2 block_m row_bytes(block_n)
# and it must fit the family's opt-in limit: sm80 163 KiB, sm86/sm89 99 KiB, sm90 227 KiB.
#
# sm90 choices measured on an H200 (bench/tiles.py, bf16, 16k tokens, seqlen 4096, TFLOP/s
# non-causal / causal; every candidate had zero spills):
#   fwd hd64:  128x64/4w 231/188 | 128x128/8w 197/156, 128x64/8w 217/147, 64x128/4w 214/169, 128x32/4w 217/168
#   fwd hd128: 64x64/4w 237/194  | 128x64/8w 206/162, 128x32/4w 234/182, 128x128/8w 223/174, 64x128/4w 234/167
#   fwd hd256: 64x64/4w 258/199  | 128x64/8w 217/175, 64x32/4w 216/163, 128x32/8w 194/152
#   bwd (single stage, before the 32-row warp tiles):
#     hd64:  64x128/8w 150/129 | 64x64/8w 105/94, 128x64/8w 113/99
#     hd128: 64x128/8w 170/146 | 64x64/8w 117/107, 128x32/8w 73/68, 128x64/8w 123/112
#     hd256: 64x64/8w 123/113  | 64x32/8w 74/70, 128x32/8w 72/67
#   bwd with two stages (v4 in bench/NOTES.md):
#     hd64:  64x128/8w/s2 220/200  | 128x128/8w/s2 241/219 (spills 20 bytes), 64x128/8w/s1 210/197
#     hd128: 64x128/8w/s2 273/247  | 64x128/8w/s1 257/239 (spills 8 bytes), 64x64/8w/s2 180/172
#     hd256: 64x64/8w/s1 193/185   | 64x64/8w/s2 198/185 (spills 44 bytes; 216 KiB)
#   third session (v5 kernels; 128x128 bwd and 128x32 fwd now compile clean):
#     bwd hd32: 128x128/8w/s2 179/159 | 64x128/8w/s2 160/142
#     bwd hd64: 128x128/8w/s2 229/214 | 64x128/8w/s2 212/197      (sm80: 128x128 needs 178 KiB, keeps 64x128)
#     fwd hd64: 128x64/4w 296/263     | 128x32/4w 277/237
#     fwd hd96: 128x32/4w 246/228     | 64x64/4w 225/203
#     fwd hd128: 128x32/4w 314/272    | 64x64/4w 293/252, 64x32/4w 250/235
#     fwd hd256: 64x64/4w 315/263     | 64x32/4w 254/234
#   fourth session (v7 kernels, bench/NOTES.md), bf16 4k:
#     fwd hd128: 128x32/4w 319/281 | 64x64/4w 291/264, 128x64/8w 274/250, 128x64/4w 341/295 (spills 124-184 bytes)
#     fwd hd256: 64x64/4w 301/268  | 128x64/8w 293/247, 64x32/4w 260/237
#     fwd hd64: 128x64/4w 309/285  | 128x128/8w 256/237, 128x128/4w 312/289 (spills 96-272 bytes)
#     bwd hd256: 64x64/8w/s1 238/218 | 64x64/8w/s2 235/213 (spills 12-116 bytes)
#   fifth session (two K/V stages for the forward; heaviest query blocks first), bf16 1k / 4k / 16k:
#     fwd hd128: 128x32/4w/s2 304/225, 345/280, 364/311 | 128x32/4w/s1 297/228, 325/285, 343/313
#     fwd hd64:  128x64/4w/s1 277/221, 304/276, 317/300 | 128x64/4w/s2 285/217, 309/272, 309/293
#     fwd hd256: 64x64/4w/s1 271/217, 292/265, 299/298  | 64x32/4w/s2 239/194, 260/223, 263/236; 64x64/4w/s2
#                (one CTA per SM) 215/179, 233/211, 238/224
#   eighth session (swizzled 256-wide tiles; the LOCAL kernels XOR dK's and dV's addresses last, as
#   since the ninth the plain ones do too), bf16 4k / 16k:
#     bwd hd256: 64x64/8w/s2 254/236, 261/266 | 64x64/8w/s1 249/233, 255/262
#   fwd hd192 takes 64x32 with two stages: 64x64 spills 148-176 bytes in its LOCAL variants and 64x32
#   with one stage 12-60 (since the LOCAL kernels' main loop has no mask code); not timed. So does
#   hd224 since the 32-byte rows of the seventh session (64x64 spilled 8-412 bytes, 64x32/s1 380).
# bwd_extras is the backward with the options of cuda_src/score.cuh (softcap, ALiBi, attn_bias, dropout,
# deterministic dQ): those need registers, and from hd96 up the plain tiles spill 16-88 bytes with
# them (hd128 64x128/8w/s2: 84-88), so it takes smaller tiles there; at hd64 one stage (two spilled
# 8-24 bytes with the v7 kernels). (The forward's options fit its plain tiles.)
# The other head dims follow their neighbours where that compiles without spills (bwd hd224
# 64x64/8w spills 12 bytes in some variants, so it keeps 64x32). sm80 has sm90's tiles where they
# fit 163 KiB and compile without spills for sm_80, smaller ones elsewhere (not yet timed on an
# A100); sm86 keeps every tile under 99 KiB.
TILES = {
    "sm90": {
        "fwd": {32: (128, 64, 4, 1), 64: (128, 64, 4, 1), 96: (128, 32, 4, 1), 128: (128, 32, 4, 2),
                160: (64, 64, 4, 1), 192: (64, 32, 4, 2), 224: (64, 32, 4, 2), 256: (64, 64, 4, 1)},
        "bwd": {32: (128, 128, 8, 2), 64: (128, 128, 8, 2), 96: (64, 128, 8, 2), 128: (64, 128, 8, 2),
                160: (64, 64, 8, 2), 192: (64, 64, 8, 2), 224: (64, 32, 8, 2), 256: (64, 64, 8, 2)},
        "bwd_options": {32: (64, 128, 8, 2), 64: (64, 128, 8, 1), 96: (64, 64, 8, 2), 128: (64, 64, 8, 2),
                       160: (64, 64, 8, 1), 192: (64, 64, 8, 1), 224: (64, 32, 8, 2), 256: (64, 32, 8, 1)},
    },
    "sm86": {
        "fwd": {32: (128, 64, 4, 1), 64: (128, 64, 4, 1), 96: (64, 64, 4, 1), 128: (64, 64, 4, 1),
                160: (64, 64, 4, 1), 192: (64, 32, 4, 2), 224: (64, 32, 4, 2), 256: (64, 32, 4, 1)},
        "bwd": {32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 96: (64, 32, 4, 2), 128: (64, 32, 4, 1),
                160: (32, 32, 4, 1), 192: (64, 32, 8, 1), 224: (32, 32, 4, 1), 256: (32, 32, 4, 1)},
        "bwd_options": {32: (64, 64, 4, 2), 64: (64, 32, 4, 2), 96: (64, 32, 4, 2), 128: (64, 32, 4, 1),
                       160: (32, 32, 4, 1), 192: (64, 32, 8, 1), 224: (32, 32, 8, 1), 256: (32, 32, 8, 1)},
    },
}
TILES["sm80"] = {
    "fwd": TILES["sm90"]["fwd"],
    "bwd": {**TILES["sm90"]["bwd"], 32: (64, 128, 8, 2), 64: (64, 128, 8, 2), 128: (64, 64, 8, 2),
            160: (64, 64, 8, 1), 192: (64, 64, 8, 1), 224: (64, 32, 8, 1), 256: (64, 32, 8, 1)},
    "bwd_options": {**TILES["sm90"]["bwd_options"], 224: (64, 32, 8, 1)},
}
FAMILY_SMEM_LIMIT = {"sm80": 163 * 1024, "sm86": 99 * 1024, "sm90": 227 * 1024}
PASSES = ("fwd", "bwd")                    # kernel passes
TABLES = ("fwd", "bwd", "bwd_options")      # tile tables per family; see kernel_pass


def kernel_pass(table):
    """The kernel pass a tile table serves: 'bwd_options' holds backward tiles."""
    return table.split("_")[0]


@dataclasses.dataclass(frozen=True)
class Tile:
    headdim: int
    block_m: int
    block_n: int
    warps: int
    stages: int

    @property
    def threads(self):
        return 32 * self.warps

    def smem_bytes(self, pass_):
        row = row_bytes(self.headdim)
        if kernel_pass(pass_) == "fwd":
            return (self.block_m + 2 * self.block_n * self.stages) * row
        return (2 * self.block_n * row + self.stages * (2 * self.block_m * row + 8 * self.block_m)
                + 2 * self.block_m * row_bytes(self.block_n))


def row_bytes(cols):
    """Bytes per shared-memory row of a tile `cols` 16-bit elements wide: as TileLayout in
    cuda_src/sm80/tile.cuh, swizzled (unpadded) at 64, 128 and 256, else padded by 16 elements."""
    return 2 * (cols if cols in (64, 128, 256) else cols + 16)


def padded_headdim(headdim):
    return next(h for h in HEADDIMS if h >= headdim)


def family_of(compute_capability):
    """'sm90' for (9, 0) and newer, 'sm80' for (8, 0), 'sm86' for the other 8.x parts."""
    major, minor = compute_capability
    if major < 8:
        raise RuntimeError(
            f"cupyflash needs a GPU of compute capability 8.0 or newer (bf16/fp16 mma.sync); "
            f"this one is {major}.{minor}")
    if major >= 9:
        return "sm90"
    return "sm80" if minor == 0 else "sm86"


def forced_family():
    forced = os.environ.get("CUPYFLASH_TILES", "").strip()
    if forced and forced not in TILES:
        raise ValueError(f"CUPYFLASH_TILES must be one of {sorted(TILES)}, got {forced!r}")
    return forced or None


def tile_for(pass_, headdim, compute_capability, smem_limit, family=None):
    """The tile for `pass_` (a table: 'fwd', 'bwd' or 'bwd_options') at a caller's head dim on a device.

    The family's entry is used when its shared memory fits `smem_limit` (the device's opt-in
    maximum per block); otherwise the smaller sm86 entry."""
    family = family or forced_family() or family_of(compute_capability)
    hd = padded_headdim(headdim)
    for candidate in (family, "sm86"):
        tile = Tile(hd, *TILES[candidate][pass_][hd])
        if tile.smem_bytes(pass_) <= smem_limit:
            return tile
    raise RuntimeError(f"no {pass_} tile for head dim {headdim} fits {smem_limit} bytes of shared memory")


def all_tiles(families=tuple(TILES)):
    """Every distinct (table, tile) of these families: what the compile checks build."""
    return sorted({(table, Tile(hd, *cfg)) for family in families for table in TABLES
                   for hd, cfg in TILES[family][table].items()}, key=lambda pt: (pt[0], dataclasses.astuple(pt[1])))


# The architectures each family's tiles are compiled and checked for: sm_90 builds every table
# (CUPYFLASH_TILES lets an H100 run the others), sm_80 the tables of the A100 and RTX/L40 parts.
COMPILE_CHECKS = {"90": tuple(TILES), "80": ("sm80", "sm86")}
