"""Tile sizes, per kernel family and GPU family, chosen at run time from the device's attributes.

Two kernel families: the mma.sync kernels (cuda_src/sm80/, every pass, sm_80 and newer) and the
wgmma kernels (cuda_src/sm90/, the forward and the backward, sm_90a: compute capability 9.0 exactly).
TILES[kernel family] holds one table per GPU family (sm90, sm86, sm80; sm100 and sm120, Blackwell's,
derived from them), then per tile table
(TABLES; the wgmma forward also has 'fwd_bias', 'fwd_short', 'fwd_options' and 'fwd_local':
forward_table) and head dim.
The kernels are templates over (head dim, block_m, block_n, warps, stages). A caller's head dim is
rounded up to the next head dim of the table (the extra columns are zero-filled and never
written). Setting CUPYFLASH_TILES to a GPU family (sm90, say) forces its table on any GPU, and
CUPYFLASH_FAMILY=mma_sync the mma.sync family where wgmma would serve, so every table and family
is tested on whatever card the tests run on.
"""

import dataclasses
import os

HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEADDIM = HEADDIMS[-1]
MMA_SYNC, WGMMA = "mma_sync", "wgmma"
KERNEL_FAMILIES = (MMA_SYNC, WGMMA)

# (block_m, block_n, warps, stages) per pass and head dim. `stages` is the number of buffers for the
# tiles a CTA streams through (bwd: Q, dO, lse, D; fwd: K and V). Shared memory per CTA
# (row = row_bytes(hd), cuda_src/sm80/tile.cuh):
#   fwd: (block_m + 2 block_n stages) row                                        (Q, K, V)
#   bwd: 2 block_n row + stages (2 block_m row + 8 block_m) + 2 block_m row_bytes(block_n)
# and it must fit the GPU family's opt-in limit (FAMILY_SMEM_LIMIT). 'bwd_options' is the backward
# of the kernels with score options (features: cuda_src/common/score.cuh; deterministic or not),
# whose options need registers; 'bwd_deterministic' that of the deterministic ones without;
# 'bwd_light' that of the light options (_kernels.LIGHT_FEATURES), which the mma.sync kernels run
# in the plain kernels' passes.
# Timings: bench/tiles.py on an H200, bf16, seqlen 1k-16k.
_DECODE = {hd: (16, 32 if hd <= 64 else 16, 4, 2) for hd in HEADDIMS if hd != 224}  # 4 warps, 2 stages (below)
_SM90 = {
    "fwd": {
        32: (128, 64, 4, 1),    # as hd64 (not timed)
        64: (128, 64, 4, 1),    # fastest measured without spills
        96: (128, 32, 4, 1),    # faster than 64x64/4w
        128: (128, 32, 4, 2),   # fastest measured without spills
        160: (64, 64, 4, 1),    # as hd256 (not timed)
        192: (64, 32, 4, 2),    # 64x64 and 64x32/s1 spill in the LOCAL variants (not timed)
        224: (64, 32, 4, 2),    # as hd192: 64x64 and 64x32/s1 spill (not timed)
        256: (64, 64, 4, 1),    # fastest measured; two stages leave one CTA per SM
    },
    "bwd": {
        32: (128, 128, 8, 2),   # faster than 64x128/8w/s2
        64: (128, 128, 8, 2),   # fastest measured
        96: (64, 128, 8, 2),    # as hd128 (not timed)
        128: (64, 128, 8, 2),   # fastest measured
        160: (64, 64, 8, 2),    # as hd256 (not timed)
        192: (64, 64, 8, 2),    # as hd256 (not timed)
        224: (64, 32, 8, 2),    # 64x64/8w spills
        256: (64, 64, 8, 2),    # faster than one stage
    },
    "bwd_options": {
        32: (64, 128, 8, 2),    # smaller than the plain tile, for the options' registers (not timed)
        64: (64, 128, 8, 2),    # 12-15% faster than 128x64 (v28); the plain 128x128 spills with the options
        96: (128, 64, 8, 2),    # 15-20% faster than 64x64 (v28); the plain tile spills with the options
        128: (128, 64, 8, 2),   # 15-22% faster than 64x64, as fast as one stage (v28); 128x32 slower
        160: (64, 64, 8, 1),    # the plain tile spills with the options
        192: (64, 64, 8, 1),    # the plain tile spills with the options
        224: (64, 32, 8, 2),    # the plain tile
        256: (128, 32, 8, 1),   # 14-18% faster than 64x32 (v28); 64x64 spills with the options
    },
    # The KV cache's decode kernel (cuda_src/sm80/decode.cuh): 16 packed query rows, block_n keys per
    # warp step, `stages` K/V buffers per warp; 'decode' reads long dense caches and large pages,
    # 'decode_small' smaller pages and short caches, 'decode_few' calls of at most a CTA per SM
    # (decode_table). hd128 timed (bench/notes/v20): 8 warps and 3 stages read long dense caches
    # 1-36% faster; 16-row pages want more warps per SM (likely: each waits for its rows' table
    # entries): 6 warps x 2 stages, two CTAs per SM, read them 1-7% faster than 4 x 2, and short
    # dense caches 2-9% faster than 8 x 3 (v40). hd64: 16 keys a step, 8 x 3 dense and 4 x 2 paged
    # (v30); 32 keys a step on 8 x 3 read few-CTA short caches 10-21% faster and long dense ones
    # 1-5%, but take a whole SM (192 KiB), which costs long 256-row pages of many CTAs 5-10% (v43).
    # hd64's dense tile on 4 stages (one CTA per SM) reads long caches 0-2% faster than on 3 (two),
    # 16 x 16k +2.3% (v67, H100). No hd224 tile: its padded rows spill on sm_90; hd256's serves it.
    "decode": _DECODE | {64: (16, 16, 8, 4), 128: (16, 16, 8, 3)},
    "decode_small": _DECODE | {64: (16, 16, 4, 2), 128: (16, 16, 6, 2)},
    "decode_few": _DECODE | {64: (16, 32, 8, 3), 128: (16, 16, 8, 3)},
}
# sm86's decode tiles: the 4-warp ones up to hd160, 2 warps above (99 KiB).
_SM86_DECODE = {hd: tile if hd <= 160 else (16, 16, 2, 2) for hd, tile in _DECODE.items()}
TILES = {
    MMA_SYNC: {
        "sm90": _SM90,
        # RTX 30/40, L40: every tile fits 99 KiB; not timed.
        "sm86": {
            "fwd": {32: (128, 64, 4, 1), 64: (128, 64, 4, 1), 96: (64, 64, 4, 1), 128: (64, 64, 4, 1),
                    160: (64, 64, 4, 1), 192: (64, 32, 4, 2), 224: (64, 32, 4, 2), 256: (64, 32, 4, 1)},
            "bwd": {32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 96: (64, 32, 4, 2), 128: (64, 32, 4, 1),
                    160: (32, 32, 4, 1), 192: (64, 32, 8, 1), 224: (32, 32, 4, 1), 256: (32, 32, 4, 1)},
            "bwd_options": {32: (64, 64, 4, 2), 64: (64, 32, 4, 2), 96: (64, 32, 4, 2), 128: (64, 32, 4, 1),
                            160: (32, 32, 4, 1), 192: (64, 32, 8, 1), 224: (32, 32, 8, 1), 256: (32, 32, 8, 1)},
            "decode": _SM86_DECODE,
            "decode_small": _SM86_DECODE,
            "decode_few": _SM86_DECODE,
        },
        # A100: sm90's tiles but where noted (not timed on an A100).
        "sm80": {
            "fwd": _SM90["fwd"],
            "bwd": {**_SM90["bwd"],
                    32: (64, 128, 8, 2),    # sm90's fits and compiles clean: a candidate to time
                    64: (64, 128, 8, 2),    # sm90's fits (162 KiB) and compiles clean: a candidate to time
                    128: (64, 64, 8, 2),    # sm90's spills in the LOCAL variants for sm_80
                    160: (64, 64, 8, 1),    # sm90's fits and compiles clean: a candidate to time
                    192: (64, 64, 8, 1),    # sm90's needs 173 KiB
                    224: (64, 32, 8, 1),    # sm90's fits (163 KiB) and compiles clean: a candidate to time
                    256: (64, 32, 8, 1)},   # sm90's needs 209 KiB
            "bwd_options": {**_SM90["bwd_options"],
                            96: (64, 64, 8, 2),    # sm90's needs 174 KiB
                            128: (128, 64, 8, 1),  # sm90's needs 194 KiB; one stage as fast on the H200 (v28)
                            224: (64, 32, 8, 1),   # as the plain tile
                            256: (64, 32, 8, 1)},  # sm90's needs more than 163 KiB
            "decode": _DECODE,  # sm90's dense hd128 tile needs 200 KiB; its paged one is not timed here
            "decode_small": _DECODE,
            "decode_few": _DECODE,
        },
    },
}
# The deterministic backward without options: each family's plain tiles, but where its code spills there.
for _tables, _instead in ((TILES[MMA_SYNC]["sm90"], {64: (128, 64, 8, 2)}),  # (the plain 128x128 spills)
                          (TILES[MMA_SYNC]["sm86"], {}), (TILES[MMA_SYNC]["sm80"], {})):
    _tables["bwd_deterministic"] = {**_tables["bwd"], **_instead}
# The light options' backward: the options' tiles, but sm90's hd128 on the plain one (forced mma.sync,
# H100, v84: ALiBi +20-23%, dropout +19-25% over the options' kernels; v85: softcap +16-17%); at hd64
# and hd256 the plain tiles spill with them, and the spill-free stand-ins lose 10-16% to the options'
# tiles (v82).
for _tables in (TILES[MMA_SYNC]["sm90"], TILES[MMA_SYNC]["sm86"], TILES[MMA_SYNC]["sm80"]):
    _tables["bwd_light"] = dict(_tables["bwd_options"])
TILES[MMA_SYNC]["sm90"]["bwd_light"][128] = TILES[MMA_SYNC]["sm90"]["bwd"][128]
# The wgmma kernels, head dims 64, 128 and 256 only (their tiles are whole 64-wide swizzled column
# blocks). Forward: block_m / 64 consumer warpgroups of 64 query rows and a producer warpgroup
# (warps = 4 (1 + block_m / 64)); `stages` K/V buffers. hd64 takes three consumers (192 rows,
# measured 8-19% faster than two from 4k tokens on, 10% slower at 1k causal, so up to 1k rows two:
# fwd_short; two on 176 or 192 keys 6-10% slower from 4k on). Wider key blocks at hd128 (176, 192:
# two stages) gain at most 1-5% from 4k on and lose 5-11% at 1k, so it keeps 128 keys on three
# stages (v26). Backward (every
# option): two consumer warpgroups of 64 keys each (hd256: both on 64 keys, dK's and dV's columns
# split) and a producer; `stages` buffers of a query block's Q, dO, lse_log2 and D. Shared memory: Tile.smem_bytes
# (cuda_src/sm90/fwd.cuh Sm90FwdTile, bwd.cuh Sm90BwdTile).
TILES[WGMMA] = {"sm90": {
    "fwd": {
        64: (192, 128, 16, 2),
        128: (128, 128, 12, 3),
        256: (128, 80, 12, 2),  # faster than 128 x 64 by 2-5% from 4k on, 3% slower at 1k causal (v26)
    },
    # Forwards of at most SHORT_SEQLEN query rows (forward_table): 192 rows pad 1k to 1152, and a
    # short causal row wastes more of a taller tile. hd64 (v27): +10% at 512 and 1k causal, even at
    # 1k, 1-8% slower at 2k and 4k.
    "fwd_short": {
        64: (128, 128, 12, 3),
        128: (128, 128, 12, 2),  # two Q buffers: short tiles run back to back (kCarry), +2.4% at 1k (v44)
    },
    # The forwards with ALiBi or dropout and no other option (forward_table): at hd64 two consumers,
    # whose products overlap the options' work, where three would run serial (sm90/fwd.cuh kSerial):
    # ALiBi +11-19%, dropout +0-6% at 4k-16k on the H100 (v75). Softcap's serial three run 10% faster.
    "fwd_options": {
        64: (128, 128, 12, 3),
    },
    # The LOCAL forwards (forward_table): two stages leave room for a second Q buffer, which lets a
    # tile's last P V run beside the next tile's first Q K^T (sm90/fwd.cuh, kCarry): +3% at 1k
    # causal, even from 4k on (v27).
    "fwd_local": {
        128: (128, 128, 12, 2),
    },
    # The forwards whose attn_bias comes in tiles (forward_table): two stages and 64-key column
    # blocks, so that a ring of bias tiles fits beside K's and V's (Sm90FwdTile::kBiasTiles; hd256 on
    # 64 keys). A bias that TMA cannot copy (float32, unaligned rows) runs the other tables' tiles.
    "fwd_bias": {
        64: (192, 128, 16, 2),
        128: (128, 128, 12, 2),
        256: (128, 64, 12, 2),
    },
    "bwd": {
        64: (128, 128, 12, 2),  # 128 query rows a step, dQ's rows split over the consumers (v31)
        128: (64, 128, 12, 2),
        256: (64, 64, 12, 2),   # the consumers split dK's and dV's columns (not timed)
    },
}}
# The options' backward: the plain tiles (not timed apart), but hd64 on 64 query rows, whose
# dropout decisions are one word a step. The deterministic one without options: the plain tiles.
TILES[WGMMA]["sm90"]["bwd_options"] = {**TILES[WGMMA]["sm90"]["bwd"], 64: (64, 128, 12, 2)}
TILES[WGMMA]["sm90"]["bwd_deterministic"] = TILES[WGMMA]["sm90"]["bwd"]
TILES[WGMMA]["sm90"]["bwd_light"] = TILES[WGMMA]["sm90"]["bwd_options"]  # (one code for every option)
# The backward without score options, causal or window edges or varlen (deterministic or not):
# hd128 on 80 query rows a step, dQ transposed (sm90/bwd.cuh, kDQTransposed).
TILES[WGMMA]["sm90"]["bwd_full"] = {128: (80, 128, 12, 2)}
SHORT_SEQLEN = 1024


def forward_table(headdim, seqlen_q, local, bias_tiles=False, features=()):
    """The wgmma forward's tile table for a call: 'fwd_bias' where its attn_bias comes in tiles, else
    'fwd_short' where the call has at most SHORT_SEQLEN query rows (the longest of a varlen batch),
    else 'fwd_options' where its score options (_kernels.FEATURES) are ALiBi or dropout or both,
    else 'fwd_local' where it is LOCAL, where that table has the head dim's tile; else 'fwd'."""
    tables = TILES[WGMMA]["sm90"]
    padded = padded_headdim(headdim, tuple(tables["fwd"]))
    overlapped_options = bool(features) and set(features) <= {"alibi", "dropout"}
    for table, applies in (("fwd_bias", bias_tiles), ("fwd_short", seqlen_q <= SHORT_SEQLEN),
                           ("fwd_options", overlapped_options), ("fwd_local", local)):
        if applies and padded in tables[table]:
            return table
    return "fwd"


# Paged caches whose pages hold at least this many rows run the dense caches' decode tile: a warp's
# blocks then share pages, as in a dense cache, and the dense tile keeps more of them in flight
# (bench/notes/v28: 1 x 64k +15%, 16 x 8k +4.5%, 64 x 4k even with 256-row pages).
DENSE_TILE_PAGE = 256


# Caches of at most this many rows per sequence run the small pages' decode tile, two or more CTAs
# per SM: each CTA streams so few rows that its start and end, where its loads are not all in
# flight, take a share of its time that a second CTA on the SM fills (bench/notes/v40: dense
# 128 x 1k hd128 +7.7%, 64 x 4k +1.6%; from 16k on the dense tile is 1-4% faster).
SHORT_CACHE = 4096


def decode_table(page_size, capacity, ctas, sms):
    """The decode tile table for a call of `ctas` CTAs (one key split each) on a GPU of `sms` SMs,
    over a cache of `page_size`-row pages (0: a dense cache) and `capacity` rows per sequence:
    'decode_few' where the CTAs are at most the SMs, the cache dense or short (the small tile
    would fill the SMs only by splitting the keys further; one CTA of 8 warps per SM reads faster
    on fewer splits: bench/notes/v43, MQA 128 x 1k hd64 1.7x, 4 x 4k and 16 x 1k hd128 +6-14%);
    else 'decode_small' for pages under DENSE_TILE_PAGE rows or at most SHORT_CACHE rows, else
    'decode'."""
    if ctas <= sms and (page_size == 0 or capacity <= SHORT_CACHE):
        return "decode_few"
    return "decode_small" if 0 < page_size < DENSE_TILE_PAGE or capacity <= SHORT_CACHE else "decode"


FAMILY_SMEM_LIMIT = {"sm80": 163 * 1024, "sm86": 99 * 1024, "sm90": 227 * 1024, "sm100": 227 * 1024,
                     "sm120": 99 * 1024}
# The tile tables of each GPU family (see kernel_pass).
TABLES = ("fwd", "bwd", "bwd_options", "bwd_deterministic", "bwd_light", "decode", "decode_small", "decode_few")


def kernel_pass(table):
    """The kernel pass a tile table serves: 'bwd_options', 'bwd_deterministic' and 'bwd_light' hold backward tiles,
    'decode_small' and 'decode_few' decode ones."""
    return table.split("_")[0]


@dataclasses.dataclass(frozen=True)
class Tile:
    headdim: int
    block_m: int
    block_n: int
    warps: int
    stages: int
    kernel_family: str = MMA_SYNC

    @property
    def threads(self):
        return 32 * self.warps

    @property
    def decode_copy_rows(self):
        """The key rows a decode warp's 16-byte copies cover in one step (sm80/decode.cuh kLaneFixed:
        32 lanes over a row's headdim / 8 chunks, on the swizzled head dims), else 1: the most kv
        heads its kernel takes together (_kvcache.decode_heads)."""
        return 256 // self.headdim if self.headdim in (64, 128, 256) else 1

    def takes_tiles_from_counter(self, local):
        """Whether this tile's wgmma forward kernel can take its tiles from a counter as it finishes
        them (kTileSlots in cuda_src/sm90/fwd.cuh): the LOCAL kernels."""
        return self.kernel_family == WGMMA and local

    @property
    def transposes_dq(self):
        """Whether this tile's wgmma backward computes dQ^T and keeps dq_accum in its accumulators'
        order, a block of block_m rows at a time (kDQTransposed in cuda_src/sm90/bwd.cuh)."""
        return self.kernel_family == WGMMA and self.headdim == 128 and self.block_m == 80

    @property
    def dq_pieces(self):
        """The pieces of a step's dQ in this tile's wgmma backward up to hd128 (kDQPieces in
        cuda_src/sm90/bwd.cuh): one where the consumers split dQ's columns (hd128) or rows (hd64 on
        128 rows), else one per consumer, each its own keys' part."""
        return 1 if self.headdim == 128 or self.block_m == 128 else 2

    @property
    def can_store_dq(self):
        """Whether this tile's wgmma backward can store a step's dQ from its consumers' registers, where
        that dQ is whole (kCanStoreDQ in cuda_src/sm90/bwd.cuh): at hd256, and up to hd128 where dQ is
        one piece, untransposed."""
        return self.kernel_family == WGMMA and (self.headdim == 256 or (self.dq_pieces == 1 and not self.transposes_dq))

    def fits_bias_tiles(self, pass_, features, local=False):
        """Whether this tile's wgmma kernel for `pass_` with these score features, LOCAL or not (a
        call's, or _kernels.Kernel's), has room for a ring of attn_bias tiles in shared memory
        (kBiasTiles of Sm90FwdTile and Sm90BwdTile): 64-key column blocks of block_m x block_n,
        16-bit, one per stage (the forward's beside one Q buffer and ALiBi's tile; the backward's
        up to hd128, and beside dropout's words only where those fit too)."""
        if not (self.kernel_family == WGMMA and "bias" in features):
            return False
        if kernel_pass(pass_) == "fwd":
            return self.block_n % 64 == 0 and self._forward_bytes(1, True, features, local) <= FAMILY_SMEM_LIMIT["sm90"]
        return self.headdim <= 128 and self._backward_bytes("dropout" in features, True) <= FAMILY_SMEM_LIMIT["sm90"]

    def adds_alibi_in_products(self, features, local=False):
        """Whether this tile's wgmma forward with these score features, LOCAL (masked) or not, adds
        ALiBi's column terms by the tensor cores (Sm90FwdTile::kAlibiProducts): ALiBi without
        softcap, on two consumers, but not in hd128's LOCAL kernels."""
        return (self.kernel_family == WGMMA and "alibi" in features and "softcap" not in features
                and self.block_n == 128 and self.block_m == 128 and not (local and self.headdim > 64))

    def _forward_bytes(self, q_buffers, bias_tiles, features=(), local=False):
        # (the wgmma forward's) alignment, Q x q_buffers, (K, V) x stages, bias tiles x stages,
        # ALiBi's operand tile (AlibiProducts::kTileBytes), barriers, a tile index per Q buffer
        bias_ring = 2 * self.block_m * self.block_n * self.stages if bias_tiles else 0
        alibi_tile = 16 * 48 + 128 if self.adds_alibi_in_products(features, local) else 0
        return (1024 + 2 * self.headdim * (q_buffers * self.block_m + 2 * self.stages * self.block_n) + bias_ring
                + alibi_tile + 8 * (3 * q_buffers + 4 * self.stages))

    def _backward_bytes(self, dropout, bias_tiles):
        # (the wgmma backward's) alignment, K, V, (Q, dO) x stages, what the consumers trade, bias
        # tiles x stages, (lse, D) x stages, dropout's words, barriers
        if self.headdim <= 128:  # dS^T x 2, dQ (in one or two pieces), a dropout word per consumer thread
            trade = 4 * self.block_n * self.block_m + 4 * self.dq_pieces * self.block_m * self.headdim
            kept = 4 * (self.threads - 128) if self.block_m == 64 and dropout else 0
        else:  # P^T, dS^T, dP^T (fp32)
            trade, kept = 8 * self.block_n * self.block_m, 0
        bias_ring = 2 * self.block_m * self.block_n * self.stages if bias_tiles else 0
        return (1024 + 2 * self.headdim * (2 * self.block_n + 2 * self.stages * self.block_m) + trade + bias_ring
                + 8 * self.stages * self.block_m + kept + 8 * (3 + 2 * self.stages))

    def smem_bytes(self, pass_, features=(), bias_tiles=False, local=False):
        """Shared memory of this tile's kernel for `pass_`; a wgmma kernel's also by its score features
        (the backward's dropout words, the forward's ALiBi tile, LOCAL or not) and its ring of bias
        tiles, if it has one."""
        if self.kernel_family == WGMMA and kernel_pass(pass_) == "fwd":
            # Q x 2 with two consumers where they fit, else 1; O where it fits but in hd64's 128-row
            # tile (Sm90FwdTile::kStagedO)
            with_q_buffers = lambda n: self._forward_bytes(n, bias_tiles, features, local)  # noqa: E731
            two = self.block_m == 128 and with_q_buffers(2) <= FAMILY_SMEM_LIMIT["sm90"]
            bytes_ = with_q_buffers(2 if two else 1)
            o_bytes = 2 * self.headdim * self.block_m
            staged_o = (bytes_ + o_bytes <= FAMILY_SMEM_LIMIT["sm90"]
                        and not (self.headdim == 64 and self.block_m == 128))
            return bytes_ + (o_bytes if staged_o else 0)
        if self.kernel_family == WGMMA:
            return self._backward_bytes("dropout" in features, bias_tiles)
        row = row_bytes(self.headdim)
        if kernel_pass(pass_) == "decode":  # Q, then per warp (K, V) x stages
            return (self.block_m + 2 * self.stages * self.block_n * self.warps) * row
        if kernel_pass(pass_) == "fwd":
            return (self.block_m + 2 * self.block_n * self.stages) * row
        return (2 * self.block_n * row + self.stages * (2 * self.block_m * row + 8 * self.block_m)
                + 2 * self.block_m * row_bytes(self.block_n))


def row_bytes(cols):
    """Bytes per shared-memory row of a tile `cols` 16-bit elements wide: as TileLayout in
    cuda_src/sm80/tile.cuh, swizzled (unpadded) at 64, 128 and 256, else padded by 16 elements."""
    return 2 * (cols if cols in (64, 128, 256) else cols + 16)


def padded_headdim(headdim, headdims=HEADDIMS):
    return next(h for h in headdims if h >= headdim)


# Blackwell runs the mma.sync family (the wgmma kernels are sm_90a's). Its tables are sm90's, on
# sm120 (99 KiB) sm86's where sm90's does not fit, but where ptxas for sm_100 or sm_120 spills in
# them under any NVRTC that knows Blackwell (12.8, PyTorch 2.8's; 12.9; 13.0): there the nearest tile
# that compiles clean under all three (bench/notes/v53; not timed). Its decode has no hd192 tile
# (sm90's and sm86's spill); hd256's serves it.
_BLACKWELL_BWD = {64: (128, 64, 8, 2), 96: (64, 64, 8, 2), 128: (64, 64, 8, 2), 256: (64, 32, 8, 2)}
_BLACKWELL_CLEAN = {
    "fwd": {64: (128, 32, 4, 2), 96: (64, 64, 4, 1), 128: (64, 64, 4, 2), 256: (64, 32, 4, 1)},
    "bwd": _BLACKWELL_BWD,
    "bwd_deterministic": _BLACKWELL_BWD,
    "bwd_light": {128: _BLACKWELL_BWD[128]},  # (sm90's options tile spills with dropout under 12.8 and 12.9)
}


def _fitting(tables, fallback, smem_limit):
    """Per tile table and head dim, `tables`' tile where its shared memory fits, else `fallback`'s."""
    return {name: {hd: cfg if Tile(hd, *cfg).smem_bytes(name) <= smem_limit else fallback[name][hd]
                   for hd, cfg in table.items()} for name, table in tables.items()}


TILES[MMA_SYNC]["sm100"] = {
    name: {hd: cfg for hd, cfg in {**table, **_BLACKWELL_CLEAN.get(name, {})}.items()
           if not (kernel_pass(name) == "decode" and hd == 192)}
    for name, table in TILES[MMA_SYNC]["sm90"].items()}
TILES[MMA_SYNC]["sm120"] = _fitting(TILES[MMA_SYNC]["sm100"], TILES[MMA_SYNC]["sm86"], FAMILY_SMEM_LIMIT["sm120"])
TILES[MMA_SYNC]["sm120"]["bwd_deterministic"][256] = (32, 32, 8, 1)  # (sm86's 4 warps spill there with 12.8)
FAMILIES = tuple(TILES[MMA_SYNC])          # GPU families


def family_of(compute_capability):
    """The GPU family: 'sm80' for 8.0, 'sm86' for the other 8.x parts, 'sm90' for 9.x, 'sm100' for
    10.x and 11.x (B200, B300, Thor), 'sm120' for 12.x and newer (RTX 50, RTX PRO, DGX Spark)."""
    major, minor = compute_capability
    if major < 8:
        raise RuntimeError(
            f"cupyflash needs a GPU of compute capability 8.0 or newer (bf16/fp16 mma.sync); "
            f"this one is {major}.{minor}")
    if major >= 12:
        return "sm120"
    if major >= 10:
        return "sm100"
    if major == 9:
        return "sm90"
    return "sm80" if minor == 0 else "sm86"


def forced_family():
    forced = os.environ.get("CUPYFLASH_TILES", "").strip()
    if forced and forced not in FAMILIES:
        raise ValueError(f"CUPYFLASH_TILES must be one of {sorted(FAMILIES, key=lambda f: int(f[2:]))}, "
                         f"got {forced!r}")
    return forced or None


def forced_kernel_family():
    forced = os.environ.get("CUPYFLASH_FAMILY", "").strip()
    if forced and forced not in KERNEL_FAMILIES:
        raise ValueError(f"CUPYFLASH_FAMILY must be one of {list(KERNEL_FAMILIES)}, got {forced!r}")
    return forced or None


def forced_choices():
    """What the environment forces (CUPYFLASH_TILES, CUPYFLASH_FAMILY), as part of every plan's key:
    raw values from os.environ's mapping of encoded names where it has one, since every launch
    asks and os.environ.get encodes the name and decodes the value each time."""
    data = getattr(os.environ, "_data", None)
    if data is None or _FORCED_KEYS is None:
        return os.environ.get("CUPYFLASH_TILES"), os.environ.get("CUPYFLASH_FAMILY")
    return data.get(_FORCED_KEYS[0]), data.get(_FORCED_KEYS[1])


_FORCED_KEYS = (tuple(map(os.environ.encodekey, ("CUPYFLASH_TILES", "CUPYFLASH_FAMILY")))
                if hasattr(os.environ, "encodekey") else None)


def kernel_family_for(pass_, compute_capability, headdim=None):
    """The kernel family that serves `pass_` ('fwd', 'bwd' or 'bwd_options') at a caller's head dim
    (None: any the table has) on a device: wgmma where its table has the pass and a tile for the
    head dim, on compute capability 9.0 with the sm90 table (sm_90a code runs on 9.0 alone), unless
    CUPYFLASH_FAMILY=mma_sync; mma.sync for everything else."""
    forced = forced_kernel_family()
    table = TILES[WGMMA]["sm90"].get(pass_, {})
    wgmma_serves = (bool(table) and (headdim is None or headdim <= max(table))
                    and tuple(compute_capability) == (9, 0) and (forced_family() or "sm90") == "sm90")
    if forced == WGMMA and not wgmma_serves:
        raise ValueError(f"CUPYFLASH_FAMILY=wgmma, but the wgmma kernels do not serve the {pass_} pass"
                         + (f" at head dim {headdim}" if headdim is not None else "")
                         + f" on compute capability {compute_capability[0]}.{compute_capability[1]} with the "
                         f"{forced_family() or family_of(compute_capability)} tiles")
    return WGMMA if wgmma_serves and forced != MMA_SYNC else MMA_SYNC


def tile_for(pass_, headdim, compute_capability, smem_limit, family=None, kernel_family=MMA_SYNC):
    """The tile for `pass_` (a table: 'fwd', 'bwd' or 'bwd_options') at a caller's head dim on a device.

    The GPU family's entry is used when its shared memory fits `smem_limit` (the device's opt-in
    maximum per block); otherwise the smaller sm86 entry (mma.sync only)."""
    family = family or forced_family() or family_of(compute_capability)
    tables = TILES[kernel_family]
    for candidate in (family, "sm86"):
        if candidate not in tables:
            continue
        table = tables[candidate][pass_]
        hd = padded_headdim(headdim, tuple(table))
        tile = Tile(hd, *table[hd], kernel_family)
        if tile.smem_bytes(pass_) <= smem_limit:
            return tile
    raise RuntimeError(f"no {kernel_family} {pass_} tile for head dim {headdim} fits {smem_limit} bytes of "
                       f"shared memory")


def all_tiles(families=FAMILIES, kernel_family=MMA_SYNC):
    """Every distinct (table, tile) of these GPU families: what the compile checks build."""
    tables = TILES[kernel_family]
    return sorted({(table, Tile(hd, *cfg, kernel_family)) for family in families if family in tables
                   for table in tables[family] for hd, cfg in tables[family][table].items()},
                  key=lambda pt: (pt[0], dataclasses.astuple(pt[1])))


# The architectures each kernel family is compiled and checked for, with the GPU families whose
# tiles each builds: mma.sync for sm_90 every table (CUPYFLASH_TILES lets an H100 run the others),
# for sm_80 the tables of the A100 and RTX/L40 parts and for sm_100 and sm_120 Blackwell's; wgmma
# for sm_90a.
COMPILE_CHECKS = {MMA_SYNC: {"90": FAMILIES, "80": ("sm80", "sm86"), "100": ("sm100",), "120": ("sm120",)},
                  WGMMA: {"90a": ("sm90",)}}
