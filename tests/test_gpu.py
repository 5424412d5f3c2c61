"""Forward and backward on the GPU against the float64 reference (cupyflash/_check.py states the rule)."""

import itertools
import zlib

import numpy
import pytest

from cupyflash import _check, _config
from cupyflash._check import Case

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_allocations")]


def _seed(case):
    return zlib.crc32(str(case).encode())  # fresh inputs per case, reproducible per case


def _assert_ok(result):
    assert result.ok, f"{result.case}: {result.describe()}"


HEADDIM_CASES = [Case(113, 113, d, dtype, causal)
                 for d, dtype, causal in itertools.product((8, 40, 72, 96, 128, 160, 256),
                                                           ("float16", "bfloat16"), (False, True))]
SEQLEN_CASES = [Case(sq, sk, 64, "bfloat16", causal, batch=1)
                for (sq, sk), causal in itertools.product(
                    [(1, 1), (1, 17), (17, 1), (17, 17), (113, 1000), (1000, 113), (1000, 1000), (2049, 2049),
                     (1, 2049), (2049, 17)], (False, True))]
GQA_CASES = [Case(113, 200, 128, "float16", causal, nheads=h, nheads_k=hk)
             for (h, hk), causal in itertools.product([(8, 2), (6, 1)], (False, True))]
PACKED_CASES = [Case(257, 257, 96, "bfloat16", causal, layout="qkvpacked") for causal in (False, True)]
# Scores that grow towards either end of the keys: the forward's running maxima move by more and
# by less than its rescale slack, block after block (the forward walks the keys from the last).
RESCALE_CASES = [Case(1000, 1000, d, dtype, causal, batch=1, key_scale=key_scale)
                 for (d, dtype), key_scale, causal in itertools.product(
                     [(64, "bfloat16"), (128, "float16"), (256, "bfloat16")], [(0.25, 4.0), (4.0, 0.25)], (False, True))]


# Softcap's scores at the ends of its range: a shift far past the cap puts every capped score of a row
# near +cap or near -cap, so P's exponents span up to 2 cap log2(e) (caps 30 to 100: 87 to 289).
# bfloat16 forwards subtract a fixed maximum up to a cap of about 55 (1 up to about 41, lower past it,
# exponents down to -120) and the running one past that and in float16 (cuda_src/common/score.cuh,
# score_bound).
SOFTCAP_RANGE_CASES = [Case(sq, sk, d, dtype, causal, softcap=cap, score_shift=shift)
                       for sq, sk, d, dtype, causal, cap, shift in [
                           (113, 1000, 128, "bfloat16", False, 30.0, 400.0),
                           (1000, 1000, 64, "bfloat16", True, 50.0, 400.0),
                           (113, 1000, 256, "bfloat16", True, 55.0, 400.0),
                           (1000, 1000, 128, "bfloat16", False, 50.0, 30.0),
                           (1000, 113, 128, "bfloat16", False, 60.0, 400.0),
                           (113, 1000, 64, "bfloat16", False, 100.0, 400.0),
                           (113, 1000, 128, "float16", True, 30.0, 400.0),
                           # spans (softcap / sqrt(d) in base 2) past 60 and past 80: score_bound's
                           # other bound, and none (common/score.cuh)
                           (113, 1000, 8, "bfloat16", False, 130.0, 400.0),
                           (1000, 1000, 16, "bfloat16", True, 180.0, 400.0),
                           (113, 1000, 32, "bfloat16", False, 350.0, 400.0)]]


@pytest.mark.parametrize("case", HEADDIM_CASES + SEQLEN_CASES + GQA_CASES + PACKED_CASES + RESCALE_CASES
                         + SOFTCAP_RANGE_CASES, ids=str)
def test_forward_backward(case):
    _assert_ok(_check.run_gpu_case(case, _seed(case)))


# More tiles than an H200 has SMs: the wgmma forward's persistent CTAs take several each.
PERSISTENT_CASES = [
    Case(1000, 1000, 128, "bfloat16", True, batch=4, nheads=8),
    Case(1000, 800, 64, "float16", False, batch=4, nheads=8, nheads_k=2),
    Case(1000, 1200, 256, "bfloat16", False, batch=3, nheads=8, window_size=(200, 50)),
    Case(777, 777, 128, "float16", False, batch=4, nheads=8, softcap=4.0, dropout_p=0.15),
    Case(1000, 1000, 64, "bfloat16", True, batch=4, nheads=8, alibi_slopes=True, attn_bias=True),
    Case.packed(tuple(range(1, 400, 13)), tuple(range(400, 1, -13)), 128, "bfloat16", True, nheads=8),
    Case.packed(tuple(range(0, 400, 13)), tuple(range(0, 400, 13)), 64, "float16", False, nheads=8, window_size=(30, 7)),
]


@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=str)
def test_forward_with_more_tiles_than_sms(case):
    _assert_ok(_check.run_gpu_case(case, _seed(case), backward=False))


def _is_backward(plan):
    """Whether a cached plan is a backward's (bwd_dot, the backward kernel, and maybe bwd_convert_dq)."""
    return any(kernel.pass_ == "bwd" for kernel in plan.kernels)


def _needs_hopper(monkeypatch):
    """Skips off compute capability 9.0; there, the device's own choice of family and tiles, whatever
    the run forces (CUPYFLASH_FAMILY, CUPYFLASH_TILES)."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma kernels run on compute capability 9.0")
    monkeypatch.delenv("CUPYFLASH_FAMILY", raising=False)
    monkeypatch.delenv("CUPYFLASH_TILES", raising=False)


@pytest.mark.parametrize("family", ["wgmma", "mma_sync"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_the_kernel_family_on_hopper(family, headdim, monkeypatch):
    """On compute capability 9.0 the forward and the plain backward run on the wgmma kernels, unless
    CUPYFLASH_FAMILY=mma_sync forces the older family (as the suite's second run on an H200 does
    throughout); both pass."""
    _needs_hopper(monkeypatch)
    from cupyflash import _plan
    monkeypatch.setattr(_plan, "_plans", {})
    monkeypatch.setenv("CUPYFLASH_FAMILY", family)
    case = Case(300, 500, headdim, "bfloat16", True, nheads=4, nheads_k=2)
    _assert_ok(_check.run_gpu_case(case, _seed(case)))
    for pass_ in ("fwd", "bwd"):
        assert {k.wgmma for plan in _plan._plans.values() for k in plan.kernels if k.pass_ == pass_} == {
            family == "wgmma"}


@pytest.mark.parametrize("case, block_m", [
    (Case(1000, 777, 128, "bfloat16", False, nheads=4, nheads_k=2), 80),
    (Case(161, 1000, 96, "float16", False, nheads=6, nheads_k=1), 80),
    (Case(1000, 113, 128, "bfloat16", False, nheads=4, nheads_k=2, deterministic=True), 80),
    (Case(1000, 777, 128, "bfloat16", True, nheads=4, nheads_k=2), 64),
    (Case(300, 300, 128, "float16", False, nheads=4, window_size=(40, 9)), 64),
    (Case(300, 300, 128, "bfloat16", False, nheads=4, softcap=4.0), 64),
    (Case.packed((17, 300, 1), (40, 300, 7), 128, "bfloat16", False, nheads=4), 80),
    # lengths whose last 80-row block reaches furthest past their 64-row padding (561 = 7 x 80 + 1 = 8 x 64 + 49)
    (Case.packed((561, 0, 241, 81, 1, 160, 49), (300, 5, 241, 700, 1, 160, 50), 120, "float16", False, nheads=4,
                 nheads_k=2), 80),
    (Case.packed((561, 241, 81), (561, 241, 81), 128, "bfloat16", True, nheads=4), 64),
], ids=str)
def test_the_full_and_the_edged_backward_tables(case, block_m, monkeypatch):
    """On compute capability 9.0 an hd128 backward without score options, causal or window edges
    (deterministic too) runs the 'bwd_full' tile (80 query rows a step, dQ transposed), varlen too
    (its sequences' padded rows 128 apart: Sequence::padded_row0); causal, window and options' calls
    keep 64-row steps. Each passes against float64."""
    _needs_hopper(monkeypatch)
    from cupyflash import _plan
    monkeypatch.setattr(_plan, "_plans", {})
    _assert_ok(_check.run_gpu_case(case, _seed(case)))
    assert {k.tile.block_m for plan in _plan._plans.values() for k in plan.kernels
            if k.pass_ == "bwd" and k.wgmma} == {block_m}


@pytest.mark.parametrize("short_seqlen", [0, 1 << 20])
@pytest.mark.parametrize("case", [
    Case(1000, 1000, 64, "bfloat16", True, batch=4, nheads=8, nheads_k=2),
    Case(113, 1000, 40, "float16", False, nheads=4, nheads_k=1, softcap=4.0, alibi_slopes=True),
    Case(1000, 113, 64, "bfloat16", True, nheads=4, attn_bias="heads", dropout_p=0.15),
    Case(1000, 1000, 64, "float16", True, nheads=4, nheads_k=2, alibi_slopes=True, dropout_p=0.1),
    Case(257, 300, 56, "float16", False, nheads=4, window_size=(40, 9)),
    Case.packed((0, 17, 1000, 129), (5, 17, 700, 129), 64, "bfloat16", True, nheads=4, nheads_k=2),
], ids=str)
def test_the_short_and_the_long_forward_tables(short_seqlen, case, monkeypatch):
    """A forward of at most SHORT_SEQLEN query rows runs the 'fwd_short' table's tile (hd64: 128
    rows, two consumers), a longer one the 'fwd' table's (192 rows, three) or with only ALiBi and
    dropout the 'fwd_options' table's, one with a 16-bit attn_bias of 16-byte aligned rows the
    'fwd_bias' table's at any length (seqlen_k 113's bias does not qualify): each runs these cases
    (every option, tails, varlen with an empty sequence)."""
    _needs_hopper(monkeypatch)
    from cupyflash import _config, _plan
    monkeypatch.setattr(_plan, "_plans", {})
    monkeypatch.setattr(_config, "SHORT_SEQLEN", short_seqlen)
    _assert_ok(_check.run_gpu_case(case, _seed(case) + bool(short_seqlen), backward=False))
    bias_tiles = any(name == "attn_bias" for name, _ in case.options) and case.seqlen_k % 8 == 0  # ('heads': 16-bit)
    only_alibi_and_dropout = case.options and {name for name, _ in case.options} <= {"alibi_slopes", "dropout_p"}
    table = _config.TILES[_config.WGMMA]["sm90"]["fwd_bias" if bias_tiles else "fwd_short" if short_seqlen
                                                 else "fwd_options" if only_alibi_and_dropout else "fwd"]
    kernels = [k for plan in _plan._plans.values() for k in plan.kernels if k.pass_ == "fwd"]
    assert {(k.tile.block_m, k.bias_tiles) for k in kernels} == {(table[64][0], bias_tiles)}


@pytest.mark.parametrize("case", [
    Case(1000, 1000, 128, "bfloat16", True, batch=4, nheads=8, nheads_k=2),
    Case(2000, 300, 96, "float16", True, batch=2, nheads=8),       # the first 1700 rows see no key
    Case(1500, 1500, 128, "bfloat16", False, batch=2, nheads=8, window_size=(100, 0)),
    Case(700, 900, 120, "float16", False, batch=3, nheads=8, nheads_k=4, window_size=(-1, 30)),
    Case.packed((0, 1, 300, 1000, 0, 129), (5, 1, 700, 1000, 0, 129), 128, "bfloat16", True, nheads=8),
], ids=str)
def test_local_forward_tiles_back_to_back(case, monkeypatch):
    """The LOCAL wgmma forward runs its tiles back to back (sm90/fwd.cuh, kCarry): a tile's last P
    V beside the next tile's first Q K^T, its O stored after; tiles whose rows see no key (written
    as zeros) end the carried tile first. Many tiles per CTA here."""
    _needs_hopper(monkeypatch)
    from cupyflash import _config, _plan
    monkeypatch.setattr(_plan, "_plans", {})
    _assert_ok(_check.run_gpu_case(case, _seed(case), backward=False))
    local_tile = _config.TILES[_config.WGMMA]["sm90"]["fwd_local"][128]
    assert {(k.tile.block_m, k.tile.stages) for plan in _plan._plans.values() for k in plan.kernels
            if k.pass_ == "fwd"} == {(local_tile[0], local_tile[3])}


@pytest.mark.parametrize("case", [
    Case(300, 500, 128, "bfloat16", True, nheads=4, nheads_k=2, softcap=5.0, alibi_slopes=True, attn_bias="full"),
    Case(200, 300, 64, "float16", False, nheads=4, nheads_k=1, attn_bias="heads", window_size=(40, 9)),
    Case(300, 500, 128, "bfloat16", True, nheads=4, nheads_k=2, softcap=5.0, dropout_p=0.1),
    Case(200, 300, 256, "float16", False, nheads=4, nheads_k=2, dropout_p=0.2, attn_bias="full"),
    Case(300, 500, 64, "bfloat16", True, nheads=4, nheads_k=2, alibi_slopes=True, deterministic=True),
    Case(200, 300, 256, "bfloat16", False, nheads=4, nheads_k=2, deterministic=True),
], ids=str)
def test_the_options_backward_family_on_hopper(case, monkeypatch):
    """On compute capability 9.0 the options' backward (dbias, dropout and the deterministic order
    included) runs on the wgmma kernels."""
    _needs_hopper(monkeypatch)
    from cupyflash import _plan
    monkeypatch.setattr(_plan, "_plans", {})
    _assert_ok(_check.run_gpu_case(case, _seed(case)))
    assert {k.wgmma for plan in _plan._plans.values() for k in plan.kernels if k.pass_ == "bwd"} == {True}


@pytest.mark.parametrize("case", [
    Case(300, 500, 128, "bfloat16", True, nheads=4, nheads_k=2, alibi_slopes=True),
    Case(1000, 113, 128, "float16", False, nheads=4, alibi_slopes=True),
    Case(200, 300, 64, "float16", False, nheads=4, nheads_k=1, dropout_p=0.15),
    Case(113, 257, 256, "bfloat16", True, nheads=2, dropout_p=0.1),
    Case(300, 500, 128, "bfloat16", True, nheads=4, nheads_k=2, softcap=30.0),
    Case(1000, 113, 64, "float16", False, nheads=2, softcap=5.0),
    Case(17, 1000, 256, "bfloat16", False, nheads=2, nheads_k=1, softcap=2.0),
], ids=str)
def test_the_light_options_backward_runs_its_own_tiles(case, monkeypatch):
    """A backward with softcap, ALiBi or dropout alone (not deterministic) runs its family's
    'bwd_light' tile (the mma.sync kernels: in the plain kernels' passes) and passes against float64."""
    import cupy
    from cupyflash import _plan, _schedule
    monkeypatch.setattr(_plan, "_plans", {})
    _assert_ok(_check.run_gpu_case(case, _seed(case)))
    kernels = [k for plan in _plan._plans.values() for k in plan.kernels if k.pass_ == "bwd"]
    family = _config.WGMMA if kernels[0].wgmma else _config.MMA_SYNC
    assert {k.tile for k in kernels} == {_schedule.tile("bwd_light", case.headdim, cupy.cuda.Device().id, family)}


@pytest.mark.parametrize("case", [
    Case(113, 1000, 64, "bfloat16", True, nheads=4, nheads_k=2, deterministic=True),
    Case(1000, 113, 64, "float16", False, nheads=2, nheads_k=1, deterministic=True),
    Case(17, 300, 128, "bfloat16", True, nheads=2, window_size=(40, 9), deterministic=True),
    Case(1000, 1000, 128, "float16", True, batch=2, nheads=2, deterministic=True),
    Case(113, 1000, 128, "bfloat16", False, nheads=4, nheads_k=2, deterministic=True),
    Case(300, 113, 256, "bfloat16", True, nheads=2, nheads_k=1, deterministic=True),
], ids=str)
def test_deterministic_backward_without_options(case):
    """The deterministic backward without score options: the plain backward's tiles, and in the
    causal and window kernels key blocks that walk their query blocks from the last (common/mask.cuh,
    QueryWalk), over tails."""
    _assert_ok(_check.run_gpu_case(case, _seed(case)))


def test_a_cached_wgmma_plan_reads_each_calls_arrays(monkeypatch):
    """The tensor maps are encoded once per plan and aimed at each call's arrays: calls with other
    arrays of the same layout reuse the plan and read their own inputs."""
    _needs_hopper(monkeypatch)
    from cupyflash import _plan
    monkeypatch.setattr(_plan, "_plans", {})
    case = Case(257, 300, 64, "float16", False, nheads=4, nheads_k=1)
    for seed in (1, 2, 3):
        _assert_ok(_check.run_gpu_case(case, seed, backward=False))
    assert len(_plan._plans) == 1 and all(plan.maps is not None for plan in _plan._plans.values())


@pytest.mark.parametrize("family", _config.FAMILIES)
@pytest.mark.parametrize("case", [Case(300, 300, d, "bfloat16", causal, batch=1, nheads=4, nheads_k=2)
                                  for d in (32, 64, 96, 128, 160, 192, 224, 256) for causal in (False, True)], ids=str)
def test_every_tile_table(family, case, monkeypatch):
    """Each family's tiles (sm80: A100, sm86: RTX 30/40 and L40, sm90: H100/H200, sm100 and sm120:
    Blackwell) run on this GPU."""
    monkeypatch.setenv("CUPYFLASH_TILES", family)
    _assert_ok(_check.run_gpu_case(case, _seed(case) + len(family)))


@pytest.mark.parametrize("family", _config.FAMILIES)
@pytest.mark.parametrize("case", [Case(150, 170, d, "float16", causal, batch=1, nheads=2, nheads_k=1, dropout_p=0.2)
                                  for d in (64, 160, 256) for causal in (False, True)], ids=str)
def test_dropout_on_every_tile_table(family, case, monkeypatch):
    """Dropout on each family's option tiles, whose warps draw their decisions in lane pairs:
    sm86's hd160 backward has warps one 8-column tile wide, half a Philox group each."""
    monkeypatch.setenv("CUPYFLASH_TILES", family)
    _assert_ok(_check.run_gpu_case(case, _seed(case) + len(family)))


@pytest.mark.parametrize("block_major", [False, True])
@pytest.mark.parametrize("case", [Case(300, 300, 64, "bfloat16", True, batch=3, nheads=4, nheads_k=2),
                                  Case(300, 260, 128, "float16", False, batch=3, nheads=4, nheads_k=2, window_size=(70, 20)),
                                  Case.packed((300, 17, 250), (300, 17, 250), 64, "bfloat16", True, nheads=4, nheads_k=2,
                                              deterministic=True)], ids=str)
def test_local_kernels_in_either_grid_order(block_major, case, monkeypatch):
    """The LOCAL kernels' grids (cuda_src/common/mask.cuh grid_slot): block-major, and head-major (taken
    where the blocks exceed the grid's y limit); the deterministic backward's turns come in launch
    order in both."""
    from cupyflash import _plan, _schedule
    monkeypatch.setattr(_plan, "_plans", {})
    block_grid = _schedule.block_grid
    monkeypatch.setattr(_schedule, "block_grid",
                        lambda blocks, heads, batch, local: block_grid(blocks, heads, batch, local and block_major))
    _assert_ok(_check.run_gpu_case(case, _seed(case) + block_major))


@pytest.mark.parametrize("group", [1, 5, 12])
@pytest.mark.parametrize("case", [Case(300, 300, 64, "bfloat16", True, batch=3, nheads=4, nheads_k=2),
                                  Case(300, 260, 128, "float16", False, batch=3, nheads=4, nheads_k=2, window_size=(70, 20)),
                                  Case(1100, 1100, 64, "float16", True, batch=2, nheads=6, nheads_k=3),  # 192-row tiles
                                  Case.packed((300, 17, 250), (300, 17, 250), 256, "bfloat16", True, nheads=4, nheads_k=2)],
                         ids=str)
def test_local_forward_in_groups_of_pairs(group, case, monkeypatch):
    """The persistent forward's block-major order in groups of (batch entry, head) pairs
    (_schedule.tile_group, fwd_tile in cuda_src/sm90/fwd.cuh): groups of one pair and of five (the last
    of 12 pairs holds two), whose tiles the CTAs take from a counter (next_tile), and of all, taken
    in rounds; the H200's shapes reach groups only at 1k tokens and more."""
    from cupyflash import _plan, _schedule
    monkeypatch.setattr(_plan, "_plans", {})
    monkeypatch.setattr(_schedule, "tile_group", lambda pairs, kv_bytes_per_pair, l2_bytes, ctas, counter_share: min(group, pairs))
    _assert_ok(_check.run_gpu_case(case, _seed(case) + group))


@pytest.mark.parametrize("most", [1, 2, 5])
@pytest.mark.parametrize("case", [Case(300, 300, 64, "bfloat16", True, batch=3, nheads=4, nheads_k=4),
                                  Case(300, 260, 128, "float16", False, batch=2, nheads=8, nheads_k=4, window_size=(70, 20)),
                                  Case(200, 200, 128, "bfloat16", True, batch=2, nheads=4, deterministic=True),
                                  Case.packed((300, 17, 250), (300, 17, 250), 256, "bfloat16", True, nheads=4, nheads_k=2)],
                         ids=str)
def test_local_backward_in_pair_groups(most, case, monkeypatch):
    """The wgmma LOCAL backward's grid in groups of (batch entry, kv head) pairs (_schedule.pair_group,
    grid_slot in cuda_src/common/mask.cuh): of one pair, of two, and of up to five (the largest
    divisor of the pairs: 4 of 12 pairs spans batch entries, 4 of 8 and 3 of 6 do not); the H200's
    shapes reach groups smaller than all pairs only at 1k tokens and more."""
    from cupyflash import _plan, _schedule
    monkeypatch.setattr(_plan, "_plans", {})
    group_of = lambda pairs: max(g for g in range(1, min(most, pairs) + 1) if pairs % g == 0)  # noqa: E731
    monkeypatch.setattr(_schedule, "pair_group", lambda batch, heads, *_: group_of(batch * heads))
    _assert_ok(_check.run_gpu_case(case, _seed(case) + most))
    backwards = [(plan.kernels[1], plan.launches[1][1]) for plan in _plan._plans.values() if _is_backward(plan)]
    assert backwards
    pairs = case.batch * case.nheads_k
    for kernel, grid in backwards:  # (the mma.sync backward, where forced, keeps its grid)
        per_group = group_of(pairs) if kernel.wgmma else case.nheads_k
        assert grid[0] == per_group and grid[0] * grid[2] == pairs


# (case, CTAs at once) -> (split key blocks, pieces each), as _schedule.tail_split gives them
@pytest.mark.parametrize("case, resident", [
    (Case(700, 500, 128, "bfloat16", batch=2, nheads=4, nheads_k=2), 13),  # (3, 4): 5 or 6 steps a piece
    (Case(700, 500, 128, "float16", batch=2, nheads=4, nheads_k=2), 15),   # (1, 11): a piece spans two heads
    (Case(1000, 1000, 64, "bfloat16", batch=2, nheads=3, nheads_k=3), 23),  # (2, 8): a step a piece
    (Case(1000, 1000, 64, "float16", batch=2, nheads=3, nheads_k=3), 40),   # (8, 4)
    (Case(113, 300, 256, "bfloat16", batch=1, nheads=3, nheads_k=1), 2),    # (1, 2): 3 steps of 2 heads each
    (Case(113, 300, 96, "float16", batch=1, nheads=3, nheads_k=1), 40),     # every key block split
], ids=str)
def test_backward_with_its_last_wave_split(case, resident, monkeypatch):
    """The plain backward's last partial wave split into pieces (cuda_src/sm80/bwd_schedule.cuh TailSplit), as if the
    GPU ran `resident` CTAs at once: the split key blocks include a partial one, and pieces that
    start and end inside a head's query blocks."""
    from cupyflash import _plan, _schedule
    monkeypatch.setattr(_plan, "_plans", {})
    monkeypatch.setattr(_schedule, "resident_ctas", lambda kernel, device: resident)
    monkeypatch.setenv("CUPYFLASH_FAMILY", "mma_sync")  # the split is the mma.sync backward's (the wgmma one is H200's)
    _assert_ok(_check.run_gpu_case(case, _seed(case) + resident))
    bwd_grids = [plan.launches[1][1] for plan in _plan._plans.values() if _is_backward(plan)]
    assert len(bwd_grids) == 1 and bwd_grids[0][2] > case.batch  # z slices past the batch: the pieces


# Backwards whose keys are one block, each with whether its wgmma kernel stores dQ itself: hd64 on
# 128 rows, hd128 on 64 and hd256 do, however many steps a CTA; hd64 on 64 rows
# (the options' tile) and hd128 on 80 don't.
ONE_KEY_BLOCK_CASES = [
    (Case(113, 60, 64, "bfloat16", True, batch=2, nheads=6, nheads_k=2), True),
    (Case(250, 64, 128, "float16", False), False),  # the 80-row tile, dQ^T's order
    (Case(120, 30, 256, "bfloat16", True, nheads=2, window_size=(20, 5)), True),  # rows that see no key
    (Case(130, 60, 200, "float16", False, nheads=2), True),  # hd256's tile, the last 16-byte chunks past the head dim
    (Case(80, 50, 96, "bfloat16", True, nheads=2, nheads_k=1, deterministic=True), True),
    (Case(150, 33, 64, "float16", False, nheads=2, softcap=5.0, alibi_slopes=True, attn_bias=True, dropout_p=0.2), False),
    (Case(150, 33, 128, "bfloat16", True, nheads=2, softcap=5.0, alibi_slopes=True, attn_bias=True, dropout_p=0.2), True),
    (Case.packed((17, 60, 1, 30), (0, 64, 33, 1), 128, "bfloat16", True, nheads=4, nheads_k=2), True),  # a sequence without keys
    (Case(250, 100, 64, "float16", False, nheads=4, nheads_k=2), True),  # 4 steps a CTA, over heads
    (Case(1000, 128, 128, "bfloat16", True, nheads=4, nheads_k=1), True),  # CTAs of many steps
    (Case(1000, 100, 64, "float16", False, nheads=6, nheads_k=2), True),  # ... over 3 query heads
]


@pytest.mark.parametrize("family", _config.KERNEL_FAMILIES)
@pytest.mark.parametrize("case, stores_on_wgmma", ONE_KEY_BLOCK_CASES, ids=str)
def test_backward_of_one_key_block_stores_dq_itself(family, case, stores_on_wgmma, monkeypatch):
    """Where the keys are one block the wgmma backward's consumers store each step's whole dQ in dq
    (FlashParams.dq_stored_by_bwd) where they hold it in rows, and no bwd_convert_dq runs (the
    mma.sync one adds and converts as ever): with GQA, a window that leaves rows no key,
    deterministic adds, every option, a varlen sequence without keys, CTAs of one step and of many."""
    import cupy
    from cupyflash import _plan
    if family == _config.WGMMA and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma kernels run on compute capability 9.0")
    monkeypatch.setattr(_plan, "_plans", {})
    monkeypatch.setenv("CUPYFLASH_FAMILY", family)
    _assert_ok(_check.run_gpu_case(case, _seed(case)))
    backwards = [plan for plan in _plan._plans.values() if _is_backward(plan)]
    assert backwards
    stored = family == _config.WGMMA and stores_on_wgmma
    for plan in backwards:
        assert plan.params["dq_stored_by_bwd"][0] == stored
        assert [k.pass_ for k in plan.kernels] == ["bwd_dot", "bwd"] + ["bwd_convert_dq"] * (not stored)


def test_forced_tile_table_gets_its_own_plan(monkeypatch):
    """A cached launch plan of the native table is not reused once CUPYFLASH_TILES forces another."""
    from cupyflash import _config, _plan, flash_attn_backward, flash_attn_func
    monkeypatch.setattr(_plan, "_plans", {})
    monkeypatch.setenv("CUPYFLASH_FAMILY", "mma_sync")  # the tables below are the mma.sync family's
    case = Case(300, 300, 128, "bfloat16")
    arrays = _check.to_cupy_inputs(case, _check.random_inputs(case, 2))
    q, k, v, dout = (arrays[n] for n in ("q", "k", "v", "dout"))
    tiles = []
    for family in ("sm90", "sm86"):
        monkeypatch.setenv("CUPYFLASH_TILES", family)
        out, lse = flash_attn_func(q, k, v, return_lse=True)
        flash_attn_backward(dout, q, k, v, out, lse)
        tiles.append(_config.Tile(128, *_config.TILES[_config.MMA_SYNC][family]["bwd"][128]))
    used = {kernel.tile for plan in _plan._plans.values() for kernel in plan.kernels if kernel.pass_ == "bwd"}
    assert tiles[0] != tiles[1] and set(tiles) <= used


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    import cupy
    from cupyflash import flash_attn_backward, flash_attn_func
    case = Case(200, 50, 64, "float16", causal=True)
    arrays = _check.to_cupy_inputs(case, _check.random_inputs(case, 7))
    q, k, v, dout = (arrays[n] for n in ("q", "k", "v", "dout"))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    empty_rows = 200 - 50  # row i sees keys j <= i - 150
    assert bool(cupy.all(out[:, :empty_rows] == 0))
    assert bool(cupy.all(cupy.isneginf(lse[:, :, :empty_rows])))
    assert bool(cupy.all(cupy.isfinite(lse[:, :, empty_rows:])))
    for grad in flash_attn_backward(dout, q, k, v, out, lse, causal=True):
        assert bool(cupy.all(cupy.isfinite(grad)))


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_key_makes_nan_of_exactly_the_rows_the_reference_does(causal, headdim, softcap):
    """A NaN in one key's vector reaches every output row that attends to that key and no other
    (tests/test_reference.py), through the online softmax's maximum, exponentials and sums."""
    import cupy
    from cupyflash import flash_attn_func
    from cupyflash.reference import attention_forward
    case = Case(300, 300, headdim, "bfloat16", causal, batch=2, nheads=4, nheads_k=2)
    inputs = _check.random_inputs(case, 5)
    inputs["k"][1, 130, 0, 3] = numpy.nan  # key 130: causal rows 0-129 do not see it
    arrays = _check.to_cupy_inputs(case, inputs)
    out = flash_attn_func(arrays["q"], arrays["k"], arrays["v"], causal=causal, softcap=softcap)
    nan = numpy.isnan(numpy.asarray(cupy.asnumpy(out)).astype(numpy.float32))
    want = numpy.isnan(attention_forward(*(inputs[n].astype(numpy.float64) for n in "qkv"), causal=causal,
                                         softcap=softcap)[0])
    assert want.any() and not want.all()
    numpy.testing.assert_array_equal(nan, want)


def test_misaligned_views_are_still_correct():
    """Views whose rows are not 16-byte aligned (odd element offset) are copied, not misread, also
    when an aligned call of the same shapes and strides has cached its launch plan first."""
    for layout in ("separate", "misaligned"):
        result = _check.run_gpu_case(Case(65, 65, 64, "float16", causal=True, layout=layout), 11)
        assert result.ok, f"{layout}: {result.describe()}"


def test_lse_view_at_a_4_byte_offset():
    """lse needs only 4-byte alignment: a view one float in is used as it is and read correctly."""
    import cupy
    from cupyflash import flash_attn_backward, flash_attn_func
    case = Case(113, 113, 64, "float16", causal=True)
    arrays = _check.to_cupy_inputs(case, _check.random_inputs(case, 5))
    q, k, v, dout = (arrays[n] for n in ("q", "k", "v", "dout"))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    shifted = cupy.empty(lse.size + 1, lse.dtype)[1:].reshape(lse.shape)
    shifted[...] = lse
    expected = flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    got = flash_attn_backward(dout, q, k, v, out, shifted, causal=True)
    for g, e in zip(got, expected):  # equal up to the order of dq's atomic additions
        assert float(cupy.abs(g.astype(cupy.float32) - e.astype(cupy.float32)).max()) <= 1e-2 * float(cupy.abs(e).max())


def test_cached_plan_checks_option_types():
    """A call that differs from a cached one only in an option's type still meets the checks."""
    import cupy
    from cupyflash import flash_attn_func
    q = cupy.asarray(numpy.random.default_rng(3).standard_normal((1, 17, 2, 64)), dtype=numpy.float16)
    flash_attn_func(q, q, q, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool, got 1"):
        flash_attn_func(q, q, q, causal=1)
    flash_attn_func(q, q, q, softmax_scale=1.0)
    with pytest.raises(TypeError, match="softmax_scale must be a positive number or None, got True"):
        flash_attn_func(q, q, q, softmax_scale=True)


def test_a_cached_plan_runs_on_a_new_thread():
    """A cached plan launched from a thread with no CUDA context current yet (autograd's backward
    thread is one) makes the device's context current first, on CuPy and torch arrays."""
    import threading
    import cupy
    from cupyflash import flash_attn_backward, flash_attn_func
    arrays = [cupy.asarray(numpy.random.default_rng(5).standard_normal((2, 65, 2, 64)), dtype=numpy.float16)]
    torch = pytest.importorskip("torch")
    arrays.append(torch.as_tensor(arrays[0], device="cuda"))
    for q in arrays:
        out, lse = flash_attn_func(q, q, q, causal=True, return_lse=True)
        want = flash_attn_backward(out, q, q, q, out, lse, causal=True, deterministic=True)
        got, errors = [], []

        def call():
            try:
                got.append(flash_attn_backward(out, q, q, q, out, lse, causal=True, deterministic=True))
            except Exception as error:  # reported below: an exception in a thread would pass unseen
                errors.append(error)
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        assert not errors, errors
        for x, y in zip(got[0], want):
            assert bool((x == y).all())


def test_params_layout_matches_numpy():
    """The device's own offsets of every FlashParams field equal the NumPy dtype's (NVRTC has no
    offsetof, so the compile-time check covers only the size)."""
    import cupy
    from cupyflash import _params, _sources
    dtype = _params.params_dtype()
    body = "\n".join(f"    offsets[{i}] = (unsigned long long)&ptr->{name};" for i, name in enumerate(dtype.names))
    source = (_sources.translation_unit("common/params.cuh")
              + 'extern "C" __global__ void layout(unsigned long long* offsets) {\n'
              + "    const FlashParams* ptr = nullptr;\n" + body + "\n}\n")
    offsets = cupy.zeros(len(dtype.names), dtype=numpy.uint64)
    cupy.RawKernel(source, "layout")((1,), (1,), (offsets,))
    assert cupy.asnumpy(offsets).tolist() == [dtype.fields[n][1] for n in dtype.names]
