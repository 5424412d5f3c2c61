"""Without a GPU: tile selection, the shared params struct, the compile cache, and an NVRTC compile of
every kernel variant with zero spill bytes in the ptxas report: all of them for sm_90, those of the
A100 and RTX/L40 tables for sm_80 and Blackwell's for sm_100 and sm_120 (_config.COMPILE_CHECKS)."""

import itertools
import os
import pathlib
import re
import threading
import types
import warnings

import numpy
import pytest

from cupyflash import _compile, _config, _kernels, _params, _plan, _sources


# ------------------------------------------------------------------------------- tile selection

@pytest.mark.parametrize("cc, smem_kib, family", [
    ((8, 0), 163, "sm80"),   # A100
    ((8, 6), 99, "sm86"),    # RTX 30
    ((8, 9), 99, "sm86"),    # RTX 40, L40
    ((9, 0), 227, "sm90"),   # H100, H200
    ((10, 0), 227, "sm100"),  # B200
    ((10, 3), 227, "sm100"),  # B300
    ((12, 0), 99, "sm120"),   # RTX 50, RTX PRO
    ((12, 1), 99, "sm120"),   # DGX Spark
])
def test_each_device_gets_its_family_table(cc, smem_kib, family, monkeypatch):
    monkeypatch.delenv("CUPYFLASH_TILES", raising=False)
    assert _config.family_of(cc) == family
    for table in _config.TABLES:
        entries = _config.TILES[_config.MMA_SYNC][family][table]
        for hd in _config.HEADDIMS:
            tile = _config.tile_for(table, hd, cc, smem_kib * 1024)
            padded = min(h for h in entries if h >= hd)  # a head dim without a tile takes the next one's
            assert tile == _config.Tile(padded, *entries[padded])
            assert tile.smem_bytes(table) <= smem_kib * 1024


def test_a_newer_gpu_with_less_shared_memory_falls_back_to_smaller_tiles(monkeypatch):
    monkeypatch.delenv("CUPYFLASH_TILES", raising=False)
    assert _config.Tile(256, *_config.TILES[_config.MMA_SYNC]["sm90"]["bwd"][256]).smem_bytes("bwd") > 99 * 1024
    tile = _config.tile_for("bwd", 256, (10, 0), 99 * 1024)       # a Blackwell part of 99 KiB
    assert tile == _config.Tile(256, *_config.TILES[_config.MMA_SYNC]["sm86"]["bwd"][256])


@pytest.mark.parametrize("cc, smem_kib", [((10, 0), 227), ((12, 0), 99)])  # B200, RTX 50
def test_blackwell_runs_mma_sync_kernels_that_the_checks_build_for_its_architecture(cc, smem_kib, monkeypatch):
    """A Blackwell GPU runs the mma.sync family (the wgmma kernels are sm_90a's) compiled for its own
    architecture: every tile its tables pick is among the variants the spill checks build for it,
    and its sm90-derived tables differ from sm90's only where sm90's spill there or do not fit."""
    monkeypatch.delenv("CUPYFLASH_TILES", raising=False)
    monkeypatch.delenv("CUPYFLASH_FAMILY", raising=False)
    arch = f"{cc[0]}{cc[1]}"
    checked = {k.tile for a, k in _kernels.compile_jobs() if a == arch}
    for table in _config.TABLES:
        assert _config.kernel_family_for(table, cc) == _config.MMA_SYNC
        for hd in _config.HEADDIMS:
            tile = _config.tile_for(table, hd, cc, smem_kib * 1024)
            assert tile in checked, (table, hd, tile)
            sm90 = _config.Tile(tile.headdim, *_config.TILES[_config.MMA_SYNC]["sm90"][table][tile.headdim])
            assert tile == sm90 or (tile.headdim in _config._BLACKWELL_CLEAN.get(table, ())
                                    or sm90.smem_bytes(table) > smem_kib * 1024), (table, hd)


def test_older_gpus_are_refused():
    with pytest.raises(RuntimeError, match=r"compute capability 8.0 or newer.*7.5"):
        _config.family_of((7, 5))


def test_every_tile_fits_its_family():
    for family, table in _config.TILES[_config.MMA_SYNC].items():
        for name in _config.TABLES:  # every head dim, but the decode tables' hd224 (hd256 serves it)
            decode = _config.kernel_pass(name) == "decode"
            blackwell = family in ("sm100", "sm120")  # (whose hd192 decode spills)
            assert set(_config.HEADDIMS) - set(table[name]) == ({224, 192} if decode and blackwell
                                                                   else {224} if decode else set())
            for hd, cfg in table[name].items():
                tile = _config.Tile(hd, *cfg)
                assert tile.smem_bytes(name) <= _config.FAMILY_SMEM_LIMIT[family], (family, name, tile)


def test_override_forces_a_table_and_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv("CUPYFLASH_TILES", "sm86")
    assert _config.tile_for("bwd", 128, (9, 0), 227 * 1024) == _config.Tile(128, *_config.TILES[_config.MMA_SYNC]["sm86"]["bwd"][128])
    monkeypatch.setenv("CUPYFLASH_TILES", "sm75")
    with pytest.raises(ValueError, match=r"CUPYFLASH_TILES must be one of .* got 'sm75'"):
        _config.tile_for("fwd", 64, (9, 0), 227 * 1024)


@pytest.mark.parametrize("pass_, cc, tiles, forced, family", [
    ("fwd", (9, 0), None, None, _config.WGMMA),              # H100, H200: the wgmma forward
    ("bwd", (9, 0), None, None, _config.WGMMA),              # the backward too (dropout and
    ("bwd_options", (9, 0), None, None, _config.WGMMA),      #   deterministic calls excepted: _plan)
    ("fwd", (9, 0), None, "mma_sync", _config.MMA_SYNC),     # forced, so the H200 tests the older family
    ("fwd", (9, 0), "sm80", None, _config.MMA_SYNC),         # an older GPU family's table is mma.sync's
    ("fwd", (8, 0), None, None, _config.MMA_SYNC),
    ("fwd", (8, 9), None, None, _config.MMA_SYNC),
    ("fwd", (10, 0), None, None, _config.MMA_SYNC),          # sm_90a code runs on 9.0 alone
    ("fwd", (9, 0), None, "wgmma", _config.WGMMA),
])
def test_the_kernel_family_follows_the_device_and_the_environment(pass_, cc, tiles, forced, family, monkeypatch):
    for name, value in (("CUPYFLASH_TILES", tiles), ("CUPYFLASH_FAMILY", forced)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert _config.kernel_family_for(pass_, cc) == family


def test_a_forced_family_that_cannot_serve_is_refused(monkeypatch):
    monkeypatch.delenv("CUPYFLASH_TILES", raising=False)
    monkeypatch.setenv("CUPYFLASH_FAMILY", "wgmma")
    with pytest.raises(ValueError, match=r"CUPYFLASH_FAMILY=wgmma.*decode pass on compute capability 9.0"):
        _config.kernel_family_for("decode", (9, 0))
    assert _config.kernel_family_for("bwd_options", (9, 0), 256) == _config.WGMMA
    with pytest.raises(ValueError, match=r"CUPYFLASH_FAMILY=wgmma.*compute capability 8.0"):
        _config.kernel_family_for("fwd", (8, 0))
    monkeypatch.setenv("CUPYFLASH_FAMILY", "hopper")
    with pytest.raises(ValueError, match=r"CUPYFLASH_FAMILY must be one of \['mma_sync', 'wgmma'\], got 'hopper'"):
        _config.kernel_family_for("fwd", (9, 0))


@pytest.mark.parametrize("headdim, padded", [(8, 64), (64, 64), (72, 128), (128, 128), (136, 256), (256, 256)])
def test_wgmma_tiles_round_head_dims_up_to_whole_column_blocks(headdim, padded):
    tile = _config.tile_for("fwd", headdim, (9, 0), 227 * 1024, kernel_family=_config.WGMMA)
    assert tile == _config.Tile(padded, *_config.TILES[_config.WGMMA]["sm90"]["fwd"][padded], _config.WGMMA)
    assert tile.smem_bytes("fwd") <= 227 * 1024 and tile.threads == 128 * (1 + tile.block_m // 64)
    kernel = _kernels.Kernel("fwd", "bfloat16", tile)
    assert kernel.wgmma and kernel.arch("90") == "90a" and "_wgmma_" in kernel.name


@pytest.mark.parametrize("headdim, seqlen_q, local, features, table", [
    (8, 1, False, (), "fwd_short"), (64, _config.SHORT_SEQLEN, True, (), "fwd_short"),
    (64, _config.SHORT_SEQLEN + 1, True, (), "fwd"), (72, 1, False, (), "fwd_short"), (72, 1, True, (), "fwd_short"),
    (128, 1000, False, (), "fwd_short"), (128, _config.SHORT_SEQLEN + 1, False, (), "fwd"),
    (128, 1 << 16, True, (), "fwd_local"), (256, 1, True, (), "fwd"),
    (64, 1 << 14, False, ("alibi",), "fwd_options"), (48, 1 << 14, True, ("alibi", "dropout"), "fwd_options"),
    (64, 1 << 14, True, ("dropout",), "fwd_options"), (64, 1000, False, ("alibi",), "fwd_short"),
    (64, 1 << 14, False, ("softcap", "alibi"), "fwd"), (64, 1 << 14, False, ("bias", "dropout"), "fwd"),
    (128, 1 << 14, True, ("alibi",), "fwd_local"), (256, 1 << 14, False, ("dropout",), "fwd")])
def test_short_local_and_options_forwards_take_their_tables_where_they_have_the_head_dim(
        headdim, seqlen_q, local, features, table):
    assert _config.forward_table(headdim, seqlen_q, local, False, features) == table
    tile = _config.tile_for(table, headdim, (9, 0), 227 * 1024, kernel_family=_config.WGMMA)
    assert tile.smem_bytes(table) <= 227 * 1024 and tile.threads == 128 * (1 + tile.block_m // 64)
    assert any(k.pass_ == "fwd" and k.tile == tile for _, k in _kernels.compile_jobs())  # compile-checked


@pytest.mark.parametrize("page_size,capacity,table", [
    (0, 1, "decode_small"), (0, _config.SHORT_CACHE, "decode_small"), (0, _config.SHORT_CACHE + 1, "decode"),
    (16, 1 << 17, "decode_small"), (_config.DENSE_TILE_PAGE - 16, 1 << 17, "decode_small"),
    (_config.DENSE_TILE_PAGE, 1 << 17, "decode"), (_config.DENSE_TILE_PAGE, _config.SHORT_CACHE, "decode_small")])
def test_small_pages_and_short_caches_take_the_small_decode_tiles(page_size, capacity, table):
    assert _config.decode_table(page_size, capacity, ctas=133, sms=132) == table


def test_every_decode_table_packs_the_same_rows_per_cta():
    """The decode plan counts its CTAs by the 'decode' table's rows before it picks the table."""
    for family, tables in _config.TILES[_config.MMA_SYNC].items():
        decode = [t for t in _config.TABLES if _config.kernel_pass(t) == "decode"]
        for headdim in tables["decode"]:
            assert len({tables[t][headdim][0] for t in decode}) == 1, (family, headdim)


@pytest.mark.parametrize("page_size", [0, 16, _config.DENSE_TILE_PAGE])
def test_calls_of_at_most_a_cta_per_sm_take_the_few_ctas_decode_tile(page_size):
    assert _config.decode_table(page_size, _config.SHORT_CACHE, ctas=132, sms=132) == "decode_few"
    assert _config.decode_table(page_size, _config.SHORT_CACHE, ctas=133, sms=132) == "decode_small"
    # Long paged caches keep their tables whatever the CTA count; long dense ones take it too.
    expected = "decode_few" if page_size == 0 else "decode_small" if page_size < _config.DENSE_TILE_PAGE else "decode"
    assert _config.decode_table(page_size, _config.SHORT_CACHE + 1, ctas=1, sms=132) == expected


@pytest.mark.parametrize("headdim, padded", [(8, 64), (64, 64), (72, 128), (128, 128), (136, 256), (256, 256)])
def test_wgmma_backward_tiles_cover_every_head_dim(headdim, padded, monkeypatch):
    monkeypatch.delenv("CUPYFLASH_FAMILY", raising=False)  # (a suite run that forces a family)
    tile = _config.tile_for("bwd", headdim, (9, 0), 227 * 1024, kernel_family=_config.WGMMA)
    assert tile == _config.Tile(padded, *_config.TILES[_config.WGMMA]["sm90"]["bwd"][padded], _config.WGMMA)
    assert tile.smem_bytes("bwd") <= 227 * 1024 and tile.threads == 3 * 128  # a producer, two consumers
    assert _config.kernel_family_for("bwd", (9, 0), headdim) == _config.WGMMA


def test_every_wgmma_variant_is_compiled_for_sm90a():
    jobs = [(arch, k) for arch, k in _kernels.compile_jobs() if k.wgmma]
    assert {arch for arch, _ in jobs} == {"90a"}
    flags = ((False, False), (True, False))  # (options, deterministic)
    assert {(k.pass_, k.tile.headdim, k.dtype, k.local, k.options, k.deterministic) for _, k in jobs
            if len(k.features) != 1} == {
        (pass_, hd, dtype, local, *f) for pass_, hd, dtype, local, f in itertools.product(
            ("fwd", "bwd"), (64, 128, 256), _kernels.DTYPES, (False, True), flags + ((True, True), (False, True)))
        if pass_ == "bwd" or f in flags}
    assert len({k.name for _, k in jobs}) == len(jobs)
    bwd_tile = next(k.tile for _, k in jobs if k.pass_ == "bwd")
    for kernel in (dict(pass_="decode", tile=bwd_tile), dict(pass_="fwd", tile=jobs[0][1].tile, even_k=True)):
        with pytest.raises(ValueError, match="wgmma kernels are forwards and backwards, without even_k"):
            _kernels.Kernel(dtype="float16", **kernel)


def test_wgmma_kernels_keep_their_products_asynchronous():
    """ptxas serialises the wgmma products where the code touches their registers in flight (it says
    so in its log, C7514/C7520): the kernels whose softmax runs beside a P V product must not be.
    Only the options' kernels of three consumer warpgroups are serial by design (sm90/fwd.cuh)."""
    for arch, kernel in _kernels.representative_jobs(_kernels.compile_jobs()):
        if kernel.wgmma and not (kernel.options and kernel.tile.block_m // 64 == 3):
            _, log = _compile.compile_kernel(kernel, arch)
            assert "Potential Performance Loss" not in log, f"{kernel.name}: {log}"


@pytest.mark.parametrize("headdim, padded", [(8, 32), (32, 32), (40, 64), (72, 96), (128, 128), (136, 160), (256, 256)])
def test_head_dims_round_up_to_a_kernel_head_dim(headdim, padded):
    assert _config.padded_headdim(headdim) == padded


def test_local_kernels_launch_block_major_within_the_grid_limit():
    from cupyflash._schedule import block_grid as _block_grid
    assert _block_grid(128, 16, 2, local=True) == ((16, 128, 2), True)
    assert _block_grid(65536, 16, 2, local=True) == ((65536, 16, 2), False)
    assert _block_grid(128, 16, 2, local=False) == ((128, 16, 2), False)


@pytest.mark.parametrize("units, steps, split", [
    (4096, 128, (4, 32)),    # hd64 at 16k on an H200 (132 CTAs at once): one short wave of 128 pieces
    (4096, 8, (4, 8)),       # hd64 at 1k: a piece per step
    (2048, 256, (68, 13)),   # hd128 / hd256 at 16k: 884 pieces in 7 waves of 20 steps, not one of 256
    (2048, 64, (68, 5)),     # ... at 4k
    (2048, 16, (0, 1)),      # ... at 1k: 2 waves of 6 steps would save 1 of 17
    (3960, 128, (0, 1)),     # whole waves
])
def test_the_backward_splits_its_last_partial_wave_where_that_saves_time(units, steps, split):
    from cupyflash._schedule import tail_split as _tail_split
    assert _tail_split(units, steps, resident=132) == split


@pytest.mark.parametrize("seqlen_q, seqlen_k, tile, stored", [
    (128, 128, (64, 128, 128), True),               # issue 18's small shape: its keys are one block
    (128, 128, (64, 128, 128, _config.MMA_SYNC), False),  # (the mma.sync kernels add dQ, convert it)
    (128, 129, (64, 128, 128), False),              # two key blocks add into one query block's dQ
    (113, 100, (256, 64, 64), False),               # ... on a tile of 64 keys
    (2048, 64, (256, 64, 64), True),                # 32 query blocks, so 32 steps a CTA or more
    (2048, 128, (128, 64, 128), True),
    (1, 1, (128, 64, 128), True),
    (100, 100, (64, 64, 128), False),               # hd64 on 64 rows: dQ in two pieces, one a consumer
    (100, 100, (128, 80, 128), False),              # hd128 on 80 rows: dQ^T
])
def test_a_wgmma_backward_of_one_key_block_stores_dq_itself(seqlen_q, seqlen_k, tile, stored):
    headdim, block_m, block_n, family = (*tile, _config.WGMMA)[:4]
    call = types.SimpleNamespace(shape=types.SimpleNamespace(seqlen_q=seqlen_q, seqlen_k=seqlen_k, headdim=headdim))
    assert _plan.dq_stored_by_bwd(call, _config.Tile(headdim, block_m, block_n, 12, 2, family)) == stored


@pytest.mark.parametrize("pairs, kv_bytes_per_pair, counter_share, group", [
    (256, 2 * 1024 * 128 * 2, None, 90),    # hd128 at 1k, batch 16: 90 pairs' K and V fill 3/4 of the L2
    (512, 2 * 1024 * 64 * 2, None, 180),    # hd64 at 1k
    (128, 2 * 1024 * 256 * 2, None, 45),    # hd256 at 1k: a round of 132 tiles spans 3 levels
    (64, 2 * 4096 * 128 * 2, None, 64),     # hd128 at 4k in rounds: 22 would fit, too few (6 levels a round)
    (64, 2 * 4096 * 128 * 2, 0.375, 11),    # ... taken from a counter: the 11 that fit 3/8 of the L2
    (16, 2 * 16384 * 128 * 2, None, 16),    # hd128 at 16k, batch 1
    (16, 2 * 16384 * 128 * 2, 0.375, 2),
    (32, 2 * 4096 * 256 * 2, 0.75, 11),     # hd256 at 4k: its counter's groups take 3/4
    (32, 2 * 128 * 128 * 2, 0.375, 32),     # everything fits
    (64, 2 * 1024 * 128 * 2, 0.375, 64),    # ... in 3/4 of the L2, though not in 3/8: all pairs still
    (4, 2 * 131072 * 256 * 2, 0.75, 1),     # one pair's K and V exceed the L2: one at a time
])
def test_the_persistent_forward_groups_pairs_whose_k_and_v_fit_the_l2(pairs, kv_bytes_per_pair, counter_share, group):
    from cupyflash._schedule import tile_group
    assert tile_group(pairs, kv_bytes_per_pair, l2_bytes=60 << 20, ctas=132, counter_share=counter_share) == group


def test_every_wgmma_forward_head_dim_has_a_counter_group_share():
    from cupyflash._schedule import COUNTER_GROUP_L2_SHARE
    for table in ("fwd", "fwd_short", "fwd_options", "fwd_local"):
        assert set(_config.TILES[_config.WGMMA]["sm90"][table]) <= set(COUNTER_GROUP_L2_SHARE)


@pytest.mark.parametrize("batch, heads, bytes_per_pair, blocks, group", [
    (4, 16, 512 * 128 * 8, 4, 64),     # hd128, 4 x 512: two waves, every pair's rows (32 MiB) fit
    (4, 32, 512 * 64 * 8, 4, 128),     # hd64, 4 x 512: four waves
    (32, 16, 512 * 128 * 8, 4, 16),    # 32 x 512: sixteen waves, a batch entry's heads at a time
    (16, 16, 1024 * 128 * 8, 8, 16),   # hd128 at 1k: all 16 heads' rows (16 MiB) fit
    (4, 16, 4096 * 128 * 8, 32, 8),    # at 4k 11 would fit: the largest divisor of 16 below
    (1, 16, 16384 * 128 * 8, 128, 2),  # at 16k
    (2, 8, 16384 * 256 * 8, 256, 1),   # hd256 at 16k: one head's rows take 32 MiB
    (1, 6, 4096 * 128 * 8 * 4, 32, 2), # GQA, 4 query heads per kv head at 4k: 16 MiB a kv head, 2 fit
    (1, 9, 4096 * 128 * 8 * 4, 32, 1), # ... and 2 do not divide 9
    (1, 7, 1 << 30, 1, 1),             # a head beyond the L2: one at a time
])
def test_the_local_wgmma_backward_groups_pairs_whose_rows_fit_the_l2(batch, heads, bytes_per_pair, blocks, group):
    from cupyflash._schedule import pair_group
    assert pair_group(batch, heads, bytes_per_pair, 60 << 20, batch * heads * blocks, 132) == group


def test_the_bias_kernels_hold_a_ring_of_bias_tiles():
    """Every 'fwd_bias' tile has room for its ring of bias tiles (Tile.fits_bias_tiles, kBiasTiles in
    cuda_src/sm90/fwd.cuh, whose shared memory the kernels' static_assert checks against), and every
    forward with bias tiles runs that table; hd128's three-stage 'fwd' tile has none. The
    backward's 'bwd_options' tiles up to hd128 have room beside Q's ring, but hd128's not beside
    dropout's words. A kernel has bias tiles only where they fit, and compiles with them: the
    compile checks hold a twin with them of every wgmma backward bias kernel that has room."""
    tables = _config.TILES[_config.WGMMA]["sm90"]
    for hd, entry in tables["fwd_bias"].items():
        tile = _config.Tile(hd, *entry, _config.WGMMA)
        kernel = _kernels.Kernel("fwd", "bfloat16", tile, features=("bias",), bias_tiles=True)
        assert tile.fits_bias_tiles("fwd", ("bias",)) and not tile.fits_bias_tiles("fwd", ("softcap",))
        ring = 2 * tile.block_m * tile.block_n * tile.stages
        kv_ring = 4 * hd * tile.block_n * tile.stages
        assert ring + kv_ring + 2 * hd * tile.block_m < kernel.smem_bytes <= _config.FAMILY_SMEM_LIMIT["sm90"]
        assert kernel.with_every_feature().bias_tiles and "_tiles" in kernel.name
        for seqlen_q, local in itertools.product((1, 1 << 16), (False, True)):
            assert _config.forward_table(hd, seqlen_q, local, True) == "fwd_bias"
            assert _config.forward_table(hd, seqlen_q, local, False) != "fwd_bias"
    three_stages = _config.Tile(128, *tables["fwd"][128], _config.WGMMA)
    assert not three_stages.fits_bias_tiles("fwd", ("bias",))
    with pytest.raises(ValueError, match="no ring of bias tiles"):
        _kernels.Kernel("fwd", "bfloat16", three_stages, features=("bias",), bias_tiles=True)
    with pytest.raises(ValueError, match="no ring of bias tiles"):
        _kernels.Kernel("fwd", "bfloat16", _config.Tile(128, *tables["fwd_bias"][128], _config.WGMMA),
                        features=("softcap",), bias_tiles=True)
    wgmma = _kernels.all_kernels(("sm90",), _config.WGMMA)
    for hd, entry in tables["bwd_options"].items():
        tile = _config.Tile(hd, *entry, _config.WGMMA)
        assert tile.fits_bias_tiles("bwd", ("bias",)) == (hd <= 128)
        assert tile.fits_bias_tiles("bwd", ("bias", "dropout")) == (hd == 64)
        for features in (("bias",), ("bias", "dropout"), ("dropout",)):
            ring = tile.fits_bias_tiles("bwd", features)
            assert _kernels.Kernel("bwd", "bfloat16", tile, features=features,
                                   bias_tiles=ring).smem_bytes <= _config.FAMILY_SMEM_LIMIT["sm90"]
        twins = {k.features for k in wgmma if k.pass_ == "bwd" and k.tile == tile and k.bias_tiles and k.local
                 and k.deterministic}
        assert twins == ({_kernels.ring_features(tile, "bwd")} if hd <= 128 else set())
    # every wgmma forward with an attn_bias on the other tables reads it without tiles
    assert any("bias" in k.features and not k.bias_tiles for k in wgmma if k.pass_ == "fwd")
    assert all(k.tile.block_n % 64 == 0 for k in wgmma if k.bias_tiles)


def test_alibi_joins_the_scores_product_in_two_consumer_forwards_without_softcap():
    """The wgmma forwards of two consumers and 128-key blocks add ALiBi's column terms by one more
    product (AlibiProducts in cuda_src/sm90/fwd.cuh), whose constant operand tile takes shared
    memory (the kernels' static_assert checks the mirror); with softcap, whose tanh takes the score
    before ALiBi, or on three consumers, or without ALiBi, or LOCAL at hd128, they do not, and their
    memory is as before."""
    tables = _config.TILES[_config.WGMMA]["sm90"]
    seen = set()
    for table, entries in tables.items():
        if _config.kernel_pass(table) != "fwd":
            continue
        for hd, entry in entries.items():
            tile = _config.Tile(hd, *entry, _config.WGMMA)
            products = tile.block_m == 128 and tile.block_n == 128
            seen.add(products)
            for features, local in itertools.product(
                    (("alibi",), ("alibi", "dropout"), ("alibi", "bias"), ("softcap", "alibi"), ("dropout",)), (False, True)):
                adds = tile.adds_alibi_in_products(features, local)
                assert adds == (products and "alibi" in features and "softcap" not in features
                                and not (local and hd > 64)), (table, hd, features, local)
                kernel = _kernels.Kernel("fwd", "bfloat16", tile, local, features=features)
                without = _kernels.Kernel("fwd", "bfloat16", tile, local, features=tuple(f for f in features if f != "alibi"))
                assert kernel.smem_bytes - without.smem_bytes == (896 if adds else 0)
                assert kernel.smem_bytes <= _config.FAMILY_SMEM_LIMIT["sm90"]
    assert seen == {True, False}
    mma_sync = _config.Tile(128, *_config.TILES[_config.MMA_SYNC]["sm90"]["fwd"][128])
    assert not mma_sync.adds_alibi_in_products(("alibi",))


def test_the_local_wgmma_forwards_can_take_tiles_from_a_counter():
    tables = _config.TILES[_config.WGMMA]["sm90"]
    for table in ("fwd", "fwd_short", "fwd_options", "fwd_local"):
        for hd, entry in tables[table].items():
            tile = _config.Tile(hd, *entry, _config.WGMMA)
            assert tile.takes_tiles_from_counter(True) and not tile.takes_tiles_from_counter(False)
    assert not _config.Tile(128, *_config.TILES[_config.MMA_SYNC]["sm90"]["fwd"][128]).takes_tiles_from_counter(True)


# ----------------------------------------------------------------------------- kernel variants

def test_the_compile_checks_build_each_table_plain_with_every_feature_and_each_feature_alone():
    kernels = _kernels.all_kernels()
    assert len({kernel.name for kernel in kernels}) == len(kernels)
    every, decode = _kernels.FEATURES, _kernels.DECODE_FEATURES
    alone = {(pass_, (f,), False) for pass_ in ("fwd", "bwd") for f in every} | {("bwd", (), True)}
    assert {(k.pass_, k.features, k.deterministic) for k in kernels if k.tile is not None} == {
        ("fwd", (), False), ("fwd", every, False), ("bwd", (), False), ("bwd", every, False), ("bwd", every, True),
        ("decode", (), False), ("decode", decode, False)} | alone
    jobs = [kernel for _, kernel in _kernels.compile_jobs()]
    for wgmma in (False, True):  # (the wgmma forward's LOCAL hd128 calls run the 'fwd_local' table)
        assert {(k.pass_, k.features, False) for k in jobs if k.wgmma == wgmma and len(k.features) == 1} == {
            (pass_, features, False) for pass_, features, deterministic in alone if features}
    # each feature alone: at hd128, once per tile; but bfloat16 forwards of softcap alone, whose fixed
    # maximum no other kernel holds, at every forward tile
    bounded = {k for k in kernels if k.features == ("softcap",) and k.dtype == "bfloat16" and k.pass_ == "fwd"}
    # and the light options' backwards (their own code, 'bwd_light'), at every head dim
    light = {k for k in kernels if k.pass_ == "bwd" and k.features in _kernels.LIGHT_FEATURES}
    assert {k.tile.headdim for k in light} == set(_config.HEADDIMS)
    assert {k.tile.headdim for k in kernels if len(k.features) == 1 and k not in bounded | light} == {128}
    assert {(k.tile, k.local, k.even_k) for k in bounded} == {
        (k.tile, k.local, k.even_k) for k in kernels if k.pass_ == "fwd" and k.dtype == "bfloat16" and not k.features}


def test_a_kernel_refuses_flags_no_call_asks_for():
    tile = _config.Tile(64, 64, 64, 4, 1)
    with pytest.raises(ValueError, match="deterministic kernel is a backward"):
        _kernels.Kernel("fwd", "float16", tile, features=("softcap",), deterministic=True)
    for pass_, features in (("bwd", ("dropout", "softcap")), ("fwd", ("window",)), ("decode", ("bias",)),
                            ("bwd_dot", ("softcap",))):
        with pytest.raises(ValueError, match=r"features are a subsequence of \("):
            _kernels.Kernel(pass_, "float16", None if pass_ == "bwd_dot" else tile, features=features)


@pytest.mark.parametrize("spilling, runs", [((), "subset"), (("subset",), "whole"), (("subset", "whole"), "whole")])
def test_a_kernel_whose_own_features_spill_runs_the_one_with_every_feature(spilling, runs, tmp_path, monkeypatch):
    tile = _config.Tile(64, 64, 64, 4, 1)
    kernels = {"subset": _kernels.Kernel("bwd", "float16", tile, True, features=("dropout",), deterministic=True)}
    kernels["whole"] = kernels["subset"].with_every_feature()
    assert kernels["whole"].features == _kernels.FEATURES and kernels["whole"].deterministic
    names = {kernel.name: role for role, kernel in kernels.items()}
    for name in names:
        (tmp_path / name).write_bytes(b"")
    monkeypatch.setattr(_compile, "compile_kernel", lambda kernel, arch: (tmp_path / kernel.name, names[kernel.name]))
    monkeypatch.setattr(_compile, "resource_report", lambda cubin, role: _compile.ResourceReport(
        200, 8 * (role in spilling), 8 * (role in spilling), 8 * (role in spilling)))
    monkeypatch.setattr(_compile, "nvrtc_version", lambda: (12, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _compile.spill_free(kernels["subset"], "90") == (kernels[runs], tmp_path / kernels[runs].name)
    # what runs still spilling (an older NVRTC's ptxas) is said, naming the kernel and the NVRTC
    assert [str(w.message) for w in caught] == ([] if "whole" not in spilling else [
        f"cupyflash: NVRTC 12.4 compiled {kernels['whole'].name} for sm_90 with 16 bytes of register spills: it "
        f"runs correctly, but slower. NVRTC 13.0 (the cuda13 extra) compiles every cupyflash kernel without; on "
        f"a CUDA 12 driver, pip install -U nvidia-cuda-nvrtc-cu12 (README: NVRTC's version)."])
    plain = _kernels.Kernel("bwd", "float16", tile)
    assert plain.with_every_feature() == plain


def test_every_kernel_feature_is_an_option_and_a_bit_of_the_kernels():
    """The features are the `kernels` of the score options (cupyflash.options), each named in
    cuda_src/common/score.cuh's namespace feature, where a kernel's FEATURES argument finds it."""
    from cupyflash import options
    named = {o.kernels for o in options.OPTIONS} - {"", "local", "deterministic"}
    assert named == set(_kernels.FEATURES) and set(_kernels.DECODE_FEATURES) <= named
    header = _sources.translation_unit("common/score.cuh")
    bits = re.search(r"namespace feature \{\s*constexpr int ([^;]*);", header).group(1)
    assert [part.split("=")[0].strip() for part in bits.split(",")] == list(_kernels.FEATURES)
    kernel = _kernels.Kernel("bwd", "float16", _config.Tile(64, 64, 64, 4, 1), features=("alibi", "dropout"))
    assert "feature::alibi | feature::dropout" in kernel.source() and kernel.name.endswith("_alibi_dropout")


def test_the_decode_cluster_merge_holds_every_split_a_cluster_launch_may_have():
    """The decode kernel's cluster merge weighs up to kClusterSplits splits a row; _kvcache merges in a
    cluster only up to _launch.MAX_CLUSTER splits, so the two must agree."""
    from cupyflash import _launch
    held = re.search(r"kClusterSplits = (\d+);", _sources.translation_unit("sm80/decode.cuh")).group(1)
    assert int(held) == _launch.MAX_CLUSTER


def test_score_modifiers_are_defined_once():
    """Each score modifier's parameters are read only by its functor in common/score.cuh, which the
    forward and the backward both call: no kernel writes a modifier's math again."""
    fields = ("softcap_inner", "softcap_outer", "alibi_slopes", "alibi_batch_stride", "attn_bias",
              "bias_batch_stride", "bias_head_stride", "bias_row_stride", "bias_is_float32")
    read = re.compile(r"\.(%s)\b" % "|".join(fields))
    root = pathlib.Path(str(_sources._source_dir()))
    headers = {path.relative_to(root).as_posix(): path.read_text() for path in root.rglob("*.cuh")}
    assert read.search(headers["common/score.cuh"])
    assert [name for name, text in headers.items() if name != "common/score.cuh" and read.search(text)] == []
    for header in ("sm80/fwd.cuh", "sm80/bwd.cuh", "sm90/fwd.cuh", "sm90/bwd.cuh"):
        assert re.search(r"ScoreMods<BF16, [^;]*FEATURES[^;]*> mods\(", headers[header]), header


# -------------------------------------------------------------------------------- params struct

def test_params_dtype_follows_the_header():
    dtype = _params.params_dtype()
    assert dtype.names[:3] == ("q", "k", "v")
    assert dtype.itemsize % 8 == 0 and dtype.fields["q_batch_stride"][1] % 8 == 0
    block = _params.make_params(seqlen_q=113, softmax_scale=0.125)
    assert block.shape == (1,) and block["seqlen_q"][0] == 113 and block["softmax_scale"][0] == numpy.float32(0.125)
    with pytest.raises(KeyError, match="unknown FlashParams fields"):
        _params.make_params(window_size=3)


def test_params_parser_refuses_what_it_cannot_map():
    text = "struct FlashParams {\n    const void* q;\n    double scale;\n};"
    with pytest.raises(RuntimeError, match="cannot map this FlashParams line"):
        _params.parse_struct(text)
    assert _params.parse_struct("struct FlashParams {\n    int a;  // note\n    long long b;\n};").itemsize == 16


# -------------------------------------------------------------------------------- sources, cache

def test_headers_are_inlined_once():
    text = _sources.translation_unit("sm80/bwd.cuh")
    assert "#include" not in text
    assert text.count("struct FlashParams {") == 1


def test_editing_a_header_changes_the_compiled_binary(tmp_path, monkeypatch):
    """The cache key covers every included header: an edited .cuh is recompiled, never served stale."""
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path))
    kernel = _kernels.Kernel("bwd_dot", "float16")
    first, _ = _compile.compile_kernel(kernel, "80")
    read = _sources.read
    monkeypatch.setattr(_sources, "read", lambda name: read(name) + ("\n// edited\n" if name == "common/ptx.cuh" else ""))
    second, _ = _compile.compile_kernel(kernel, "80")
    assert first != second and first.exists() and second.exists()


def test_a_compiled_cubin_is_its_whole_elf(tmp_path, monkeypatch):
    """The cached cubin is as long as its ELF header says (CuPy's getCUBIN drops the last byte;
    nvdisasm and cuobjdump refuse the file without it), and whole_elf leaves a whole one alone."""
    import struct
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path))
    path, _ = _compile.compile_kernel(_kernels.Kernel("bwd_dot", "bfloat16"), "90")
    cubin = path.read_bytes()
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    assert len(cubin) == max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    assert _compile.whole_elf(cubin) == cubin and _compile.whole_elf(cubin[:-1]) == cubin


# ---------------------------------------------------------------------- every kernel, zero spills

# Every variant where CUPYFLASH_COMPILE_ALL is set (CI sets it; a cold sweep takes minutes on two
# cores), else the representative set that `python -m cupyflash check` compiles.
SWEEP = (_kernels.compile_jobs() if os.environ.get("CUPYFLASH_COMPILE_ALL")
         else _kernels.representative_jobs(_kernels.compile_jobs()))


@pytest.fixture(scope="session")
def resource_reports(request):
    # The user's kernel cache, shared with `python -m cupyflash check`: its key covers the full source,
    # the options and the NVRTC version, and the ptxas log is cached beside each cubin, so a cached
    # kernel reports what a fresh compile would. A cold cache takes minutes: `check`'s progress shows.
    from cupyflash.__main__ import _Progress
    jobs = SWEEP
    progress, plugins = _Progress(len(jobs), "kernels compiled"), request.config.pluginmanager

    def shown(done, total, label):
        with plugins.getplugin("capturemanager").global_and_fixture_disabled():
            if done == 1:
                plugins.getplugin("terminalreporter").write_line("")  # off the row of dots
            progress(done, label)
    results = _compile.compile_all(jobs, progress=shown)
    return {(arch, kernel.name): report for arch, kernel, report in results}


@pytest.mark.parametrize("arch, kernel", SWEEP, ids=lambda x: x if isinstance(x, str) else x.name)
def test_kernel_compiles_without_spills(resource_reports, arch, kernel):
    report = resource_reports[(arch, kernel.name)]
    assert report.clean, f"sm_{arch} {kernel.name}: {report}"
    assert report.registers <= 255


def test_ptxas_log_parser():
    log = ("ptxas info    : Function properties for k\n"
           "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 1 barriers\n")
    assert _compile.ptxas_report(log) == (168, 16, 8, 4)
    assert _compile.ptxas_report("a log with only front-end warnings") is None


@pytest.mark.parametrize("tile", [(64, 64, 4, 1), (128, 64, 4, 1)])  # the second spills: 255 registers and a stack frame
def test_cubin_resources_agree_with_ptxas(tile, tmp_path, monkeypatch):
    """The registers and stack frame read from the cubin equal what ptxas reported, with and
    without spills, so the cubin can stand in where NVRTC's log lacks the report."""
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path))
    cubin_path, log = _compile.compile_kernel(_kernels.Kernel("fwd", "bfloat16", _config.Tile(128, *tile), True), "90")
    reported = _compile.ptxas_report(log)
    if reported is None:  # seen with the H200 machine's NVRTC for kernels without spills; CI's NVRTC reports
        pytest.skip("this NVRTC returned no ptxas report in its log to compare with")
    registers, stack_frame, spill_stores, _ = reported
    assert _compile.cubin_resources(cubin_path.read_bytes()) == (registers, stack_frame)
    if tile == (128, 64, 4, 1):
        assert stack_frame > 0 and spill_stores > 0
    report = _compile.resource_report(cubin_path.read_bytes(), "")
    assert report.spills == (0 if stack_frame == 0 else None)


def _backward_tile(block_m):
    """The wgmma backward's tile of `block_m` query rows (80: hd128's, which transposes dQ)."""
    return _config.Tile(64 if block_m == 128 else 128, block_m, 128, 12, 2, _config.WGMMA)


def _varlen_padded_blocks(lengths, block_m, gap):
    """(starts, ends) of a varlen batch's sequences in the padded rows as Sequence::padded_row0 (in
    common/mask.cuh) places them with this gap: each ends after its whole query blocks (whose
    dq_accum the 80-row backward writes in fragment order) and its rows rounded up to 64
    (flash_bwd_dot's)."""
    first = numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(int)
    starts = [64 * -(-f // 64) + gap * b for b, f in enumerate(first[:-1])]
    return starts, [s + max(-(-int(n) // block_m) * block_m, -(-int(n) // 64) * 64) for s, n in zip(starts, lengths)]


@pytest.mark.parametrize("block_m, transposed_dq", [(64, False), (80, True)])
def test_varlen_sequences_padded_rows_keep_their_blocks_apart(block_m, transposed_dq):
    """A varlen batch's sequences keep their blocks' padded rows apart and within _padded_rows: a
    gap of 64 rows a sequence, 128 with the 80-row backward, whose blocks reach further."""
    rng = numpy.random.default_rng(block_m)
    assert _backward_tile(block_m).transposes_dq == transposed_dq
    gap = 128 if transposed_dq else 64
    for _ in range(300):
        lengths = rng.integers(0, 700, size=int(rng.integers(1, 9)))
        lengths[rng.random(len(lengths)) < 0.3] = rng.choice([0, 1, 79, 81, 161, 241, 561])
        starts, ends = _varlen_padded_blocks(lengths, block_m, gap)
        rows = _plan._padded_rows(types.SimpleNamespace(varlen=True, total_q=int(lengths.sum()), batch=len(lengths)),
                                  _backward_tile(block_m))
        assert all(s % 64 == 0 for s in starts) and ends[-1] <= rows
        assert all(end <= start for end, start in zip(ends, starts[1:])), (lengths, starts, ends)
    if transposed_dq:  # (the 64-row gap is short for it: 81 rows from packed row 2 end 32 rows into the next's)
        starts, ends = _varlen_padded_blocks(numpy.array([2, 81, 1]), block_m, 64)
        assert ends[1] - starts[2] == 32


@pytest.mark.parametrize("block_m", [64, 80, 128])
@pytest.mark.parametrize("varlen", [False, True])
def test_the_parameters_stride_over_the_padded_rows_the_scratch_holds(block_m, varlen):
    """A backward's parameter block steps from head to head (and batch entry) by the padded rows
    its scratch is allocated with per head (_padded_rows), the 80-row tile's wider varlen gaps too."""
    batch, nheads, seqlen = 3, 4, 81
    shape = types.SimpleNamespace(batch=batch, nheads=nheads, nheads_k=2, seqlen_q=seqlen, seqlen_k=seqlen,
                                  total_q=batch * seqlen, total_k=batch * seqlen, headdim=128, varlen=varlen)
    call = types.SimpleNamespace(shape=shape, scale=0.1, checked={})
    tile = _backward_tile(block_m)
    params = _plan._param_block(call, tile, {}, {}, False)
    rows = _plan._padded_rows(shape, tile)
    assert params["padded_head_stride"][0] == rows
    assert params["padded_batch_stride"][0] == (0 if varlen else nheads * rows)
    if varlen and tile.transposes_dq:  # the gaps of 128 rows a sequence, past the 64 of the other tiles
        assert rows == 64 * -(-batch * seqlen // 64) + 128 * (batch + 1)


@pytest.mark.parametrize("block_m", [64, 80, 128])
@pytest.mark.parametrize("seqlen", [1, 63, 64, 80, 81, 1000, 1024])
def test_a_heads_padded_rows_hold_whole_query_blocks_from_a_multiple_of_64(seqlen, block_m):
    """The backward's padded rows per head (dq_accum, lse_log2, D): whole query blocks of the tile,
    rounded up to 64 (every head's rows start at a multiple of 64, Sequence::padded_row0)."""
    rows = _plan._padded_rows(types.SimpleNamespace(varlen=False, seqlen_q=seqlen), _backward_tile(block_m))
    assert rows % 64 == 0 and rows >= -(-seqlen // block_m) * block_m and rows < -(-seqlen // block_m) * block_m + 64


def test_plan_keeps_small_scratch_per_stream_without_a_gpu(monkeypatch):
    """Plan.call's kept scratch: one workspace per stream, allocated by the stream's first call and
    found with its addresses by the later ones; a call under graph capture gets its own and leaves
    the kept ones alone; past _MAX_KEPT_SCRATCH streams the kept workspaces start afresh, their
    addresses with them (none is launched on after it may be freed)."""
    monkeypatch.setattr(_plan, "_MAX_KEPT_SCRATCH", 2)
    allocated, launched, capturing = [], [], [False]

    def allocate(inputs):
        allocated.append(types.SimpleNamespace(ptr=1_000_000 * (len(allocated) + 1)))
        return allocated[-1]

    plan = _plan.Plan.__new__(_plan.Plan)
    plan.input_names, plan.alignments, plan.seed_slot, plan.maps, plan.hands_back = ["q"], [16], None, None, False
    plan.pointer_of, plan.capturing = (lambda a: a.ptr), (lambda: capturing[0])
    plan.current_context, plan.context, plan.lock = (lambda: "context"), "context", threading.Lock()
    plan.result_names, plan.allocators, plan.finish = [], [], None
    plan.workspaces = [_plan._Workspace(allocate, [(1, 0), (2, 512)], True, 1024, False)]
    plan.slots, plan.scratch_offsets = [0, 1, 2], [[0, 512]]
    plan.keeps_buffers, plan.scratch_by_stream, plan.kept_scratch, plan.captured_scratch = True, {}, {}, []
    plan.words = [0] * 3
    plan.launch_kernel = lambda function, *args: launched.append(list(plan.words[1:]))
    plan.launches = [("bwd", (1, 1, 1), 128, 0, 0, None)]
    q = types.SimpleNamespace(ptr=4096)

    def call(stream):
        plan.stream_of = lambda: stream
        plan.call([q])
        return launched[-1]

    first = call(7)
    assert first == [1_000_000, 1_000_512] and call(7) == first and len(allocated) == 1
    assert call(8) == [2_000_000, 2_000_512] and call(7) == first and len(allocated) == 2
    capturing[0] = True
    assert call(7) == [3_000_000, 3_000_512] and plan.captured_scratch == [[allocated[2]]]
    capturing[0] = False
    assert call(7) == first and call(8) == [2_000_000, 2_000_512] and len(allocated) == 3
    assert call(9) == [4_000_000, 4_000_512]  # a third stream: the kept ones start afresh
    assert set(plan.kept_scratch) == {9} and call(7) == [5_000_000, 5_000_512] and len(allocated) == 5
