"""flash_attn_with_kvcache on the GPU (marked `gpu`), CuPy and torch arrays: out within the
project's 2x rule of the float64 reference (the naive low-precision yardstick computed per
sequence on the same rotated queries and cached keys), lse likewise, and the caches appended in
place as the NumPy path appends them (to one unit of the dtype: the GPU rotates in float32); dense
and paged caches, cache_batch_idx, cache_leftpad, rotary both ways, decode to chunked prefill,
and a CUDA-graph replay with new lengths written on the device."""

import functools

import numpy as np
import pytest

import cupyflash
from cupyflash import reference
from cupyflash._arrays import bfloat16_dtype
from reference_helpers import paged_varlen_case

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_allocations")]  # outputs start as NaN

UNIT = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def _case(rng, dtype, batch=3, seqlen_q=1, nheads=8, nheads_k=2, headdim=64, capacity=256, seqlen_new=1,
          rotary_dim=32, paged_page=0):
    np_dtype = bfloat16_dtype() if dtype == "bfloat16" else np.dtype(dtype)
    draw = lambda *shape: rng.standard_normal(shape).astype(np_dtype)  # noqa: E731
    case = dict(q=draw(batch, seqlen_q, nheads, headdim))
    if paged_page:
        pages = capacity // paged_page
        blocks = batch * pages + 3
        case.update(k_cache=draw(blocks, paged_page, nheads_k, headdim), v_cache=draw(blocks, paged_page, nheads_k, headdim),
                    block_table=rng.permutation(blocks)[:batch * pages].reshape(batch, pages).astype(np.int32))
    else:
        case.update(k_cache=draw(batch, capacity, nheads_k, headdim), v_cache=draw(batch, capacity, nheads_k, headdim))
    if seqlen_new:
        case.update(k=draw(batch, seqlen_new, nheads_k, headdim), v=draw(batch, seqlen_new, nheads_k, headdim))
    case["cache_seqlens"] = rng.integers(0, capacity - seqlen_new + 1, batch).astype(np.int32)
    if rotary_dim and seqlen_new:
        angles = rng.uniform(0, 2 * np.pi, (capacity + seqlen_q, rotary_dim // 2))
        case.update(rotary_cos=np.cos(angles).astype(np_dtype), rotary_sin=np.sin(angles).astype(np_dtype))
    return case


def _yardstick(case, dtype, options):
    """(reference out, lse, caches after the append; naive low-precision out and lse), per sequence."""
    k_cache, v_cache = case["k_cache"].copy(), case["v_cache"].copy()
    q = np.asarray(case["q"], np.float64)
    # The reference's own function takes mixed dtypes: q in float64, the caches appended in theirs.
    ref_out, ref_lse = reference.kvcache_attention(
        q, k_cache, v_cache, case.get("k"), case.get("v"), case.get("rotary_cos"), case.get("rotary_sin"),
        case["cache_seqlens"], options.get("cache_batch_idx"), options.get("cache_leftpad"), case.get("block_table"),
        q.shape[-1] ** -0.5, options.get("causal", False), window_size=options.get("window_size", (-1, -1)),
        softcap=options.get("softcap", 0.0), rotary_interleaved=options.get("rotary_interleaved", True),
        alibi_slopes=options.get("alibi_slopes"))
    batch, seqlen_q = q.shape[:2]
    local = options.get("causal", False) or options.get("window_size", (-1, -1)) != (-1, -1)
    lengths = case["cache_seqlens"]
    new = 0 if "k" not in case else case["k"].shape[1]
    page = k_cache.shape[1]
    capacity = case["block_table"].shape[1] * page if "block_table" in case else k_cache.shape[1]
    lowp_out, lowp_lse = np.zeros(ref_out.shape), np.full(ref_lse.shape, -np.inf)
    for b in range(batch):
        qb = q[b]
        if "rotary_cos" in case:
            positions = lengths[b] + (np.arange(seqlen_q) if local else np.zeros(seqlen_q, int))
            qb = reference.rotate(qb, case["rotary_cos"], case["rotary_sin"], positions,
                                  options.get("rotary_interleaved", True))
        start = 0 if options.get("cache_leftpad") is None else options["cache_leftpad"][b]
        row = b if options.get("cache_batch_idx") is None else options["cache_batch_idx"][b]
        rows, blocks = reference.kvcache.cache_positions(capacity, case.get("block_table"), b, page)
        keys = np.arange(start, lengths[b] + new)
        if not len(keys):
            continue
        at = (blocks[keys], rows[keys]) if "block_table" in case else (row, rows[keys])
        kb, vb = (np.asarray(cache[at], np.float64)[None] for cache in (k_cache, v_cache))
        slopes = options.get("alibi_slopes")
        o, l = reference.attention_forward_lowp(qb[None], kb, vb, dtype, None, options.get("causal", False),
                                                return_lse=True, window_size=options.get("window_size", (-1, -1)),
                                                softcap=options.get("softcap", 0.0),
                                                alibi_slopes=None if slopes is None else np.asarray(slopes)[b]
                                                if np.ndim(slopes) == 2 else np.asarray(slopes))
        lowp_out[b], lowp_lse[b] = o[0], l[0]
    return ref_out, ref_lse, k_cache, v_cache, lowp_out, lowp_lse


def _error(got, want, rows=None):
    diff = np.abs(np.asarray(got, np.float64) - want)
    return float((diff if rows is None else diff[rows]).max(initial=0))


def _run_and_check(case, dtype, framework, **options):
    import cupy
    ref_out, ref_lse, ref_k, ref_v, lowp_out, lowp_lse = _yardstick(case, dtype, options)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        torch.full((64 << 20,), float("nan"), device="cuda")  # freed at once: torch's cached blocks hold NaN
        to_device = lambda a: torch.from_dlpack(cupy.asarray(a))  # noqa: E731
        to_host = lambda t: cupy.asnumpy(cupy.from_dlpack(t))  # noqa: E731
    else:
        to_device, to_host = cupy.asarray, cupy.asnumpy
    arrays = {n: to_device(v) for n, v in case.items()}
    device_options = {n: to_device(v) if isinstance(v, np.ndarray) else v for n, v in options.items()}
    out, lse = cupyflash.flash_attn_with_kvcache(**arrays, **device_options, return_softmax_lse=True)
    out, lse = to_host(out), to_host(lse)
    floor = UNIT[dtype] * float(np.abs(ref_out).max(initial=1))
    assert not np.isnan(np.asarray(out, np.float64)).any()
    assert _error(out, ref_out) <= 2 * _error(lowp_out, ref_out) + floor, "out"
    seen = ~np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), ~seen), "lse: rows without keys"
    assert _error(lse, ref_lse, seen) <= 2 * _error(lowp_lse, ref_lse, seen) + 2.0 ** -20 * 64, "lse"
    for name, want in (("k_cache", ref_k), ("v_cache", ref_v)):
        got = np.asarray(to_host(arrays[name]), np.float64)
        np.testing.assert_allclose(got, np.asarray(want, np.float64), rtol=2 * UNIT[dtype], atol=2 * UNIT[dtype],
                                   err_msg=name)


def _results_of(monkeypatch, module, name):
    """The list each later call of module.name appends its result to (the function still runs)."""
    results, function = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: results.append(function(*args)) or results[-1])
    return results


def _kv_heads_a_tile(plans):
    """The kv heads a decode tile took in each of `plans` (_kvcache._new_plan's results)."""
    return [1 << plan.params["decode_heads_log2"].item() for plan in plans]


@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("paged_page", [0, 16, 256])
def test_cache_rows_past_the_keys_are_never_used(headdim, paged_page):
    """Every cache row past a sequence's keys (and every block no table names) holds NaN or inf, as
    a cache from torch.empty may: the kernels use the keys alone (their copies of rows past the
    keys read nothing and fill zeros)."""
    rng = np.random.default_rng(headdim + paged_page)
    case = _case(rng, "bfloat16", batch=4, headdim=headdim, capacity=256 if paged_page != 256 else 512,
                 paged_page=paged_page, rotary_dim=0)
    case["cache_seqlens"] = np.array([0, 16, 112, 199], np.int32)  # (+1 appended: 1, 17, 113, 200 keys)
    bad = np.array([np.nan, np.inf, -np.inf], np.float32)
    for cache in (case["k_cache"], case["v_cache"]):
        poison = np.ones(cache.shape[:-1], bool)
        for b, length in enumerate(case["cache_seqlens"] + 1):
            positions = np.arange(length)
            if paged_page:
                poison[case["block_table"][b, positions // paged_page], positions % paged_page] = False
            else:
                poison[b, positions] = False
        cache[poison] = bad[rng.integers(0, 3, poison.sum())][:, None].astype(cache.dtype)
    _run_and_check(case, "bfloat16", "cupy")


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (4, 4), (1, 0), (33, 33)])
def test_dense_decode_to_chunked_prefill(framework, dtype, seqlen_q, seqlen_new):
    rng = np.random.default_rng(seqlen_q * 7 + seqlen_new)
    case = _case(rng, dtype, seqlen_q=seqlen_q, seqlen_new=seqlen_new)
    _run_and_check(case, dtype, framework, causal=True)


@pytest.mark.parametrize("page", [16, 32, 64, 256])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("headdim", [64, 128])  # (key blocks of 32 and 16 rows)
def test_paged_caches_and_rotary(page, interleaved, headdim):
    rng = np.random.default_rng(page + interleaved + headdim)
    case = _case(rng, "bfloat16", seqlen_q=3, seqlen_new=3, capacity=512, headdim=headdim, paged_page=page)
    _run_and_check(case, "bfloat16", "cupy", causal=True, rotary_interleaved=interleaved)


@pytest.mark.parametrize("headdim, nheads_k", [(64, 48), (128, 48), (64, 40)])
def test_paged_caches_by_cta_count(headdim, nheads_k):
    """3 x 48 KV heads, more CTAs than an H200's 132 SMs: the small pages' own tile; 3 x 40 at
    hd64, one split on the few-CTA tile, whose 32-row blocks span two 16-row pages."""
    rng = np.random.default_rng(headdim + nheads_k)
    case = _case(rng, "bfloat16", seqlen_q=2, seqlen_new=2, nheads=nheads_k, nheads_k=nheads_k, capacity=512,
                 headdim=headdim, paged_page=16)
    _run_and_check(case, "bfloat16", "cupy", causal=True)


@pytest.mark.parametrize("nheads, nheads_k, seqlen_q", [(48, 48, 16), (192, 48, 1), (48, 48, 1), (96, 48, 2), (32, 8, 1)])
@pytest.mark.parametrize("page", [0, 256])
@pytest.mark.parametrize("headdim", [64, 128])
def test_long_caches_by_kv_heads_per_tile(headdim, page, nheads, nheads_k, seqlen_q, monkeypatch):
    """Caches of 4352 rows (past SHORT_CACHE), dense and in 256-row pages. 3 x 48 kv heads, more
    CTAs than an H200 or H100 has SMs, run the 'decode' table's tile (hd64 on a 4-stage ring): 16
    query rows a head fill a tile each; one or two of GQA 48/192 or 48/96, and MHA, leave room for
    several kv heads a tile (hd64 four, hd128 two), whose rows of a token are read as one run and
    masked to each row's own head. 3 x 8 kv heads: the few-CTA tile, several heads only in pages.
    (Their splits are short: HEADS_SPLIT_ROWS is lifted here, so that the tiles take what
    decode_heads allows.)"""
    from cupyflash import _kvcache
    tables, plans = _results_of(monkeypatch, _kvcache, "_table"), _results_of(monkeypatch, _kvcache, "_new_plan")
    monkeypatch.setattr(_kvcache._plan, "_plans", {})
    monkeypatch.setattr(_kvcache, "HEADS_SPLIT_ROWS", 0)
    rng = np.random.default_rng(headdim + page + nheads + seqlen_q)
    case = _case(rng, "bfloat16", seqlen_q=seqlen_q, seqlen_new=1, nheads=nheads, nheads_k=nheads_k, capacity=4352,
                 headdim=headdim, rotary_dim=0, paged_page=page)
    case["cache_seqlens"][1] = 4351  # a full cache after the append
    _run_and_check(case, "bfloat16", "cupy", causal=True)
    several = seqlen_q < 16 and (nheads_k == 48 or page > 0)
    assert _kv_heads_a_tile(plans) == [{64: 4, 128: 2}[headdim] if several else 1]
    if nheads_k == 48:
        assert tables[0] == "decode"  # (the one-head call's table)


@pytest.mark.parametrize("batch, capacity, nheads, nheads_k, split_rows, heads", [
    (1, 16384, 32, 8, None, 1),    # (v69: four heads' splits of 1024 rows, 11% slower)
    (2, 16384, 32, 8, None, 1),
    (3, 4352, 192, 48, None, 1),   # 36 CTAs of four heads split 3 ways: 5802 rows a split; 72 of two, 2901
    (3, 4352, 192, 48, 4096, 4)])
def test_kv_heads_a_tile_while_their_splits_are_long(batch, capacity, nheads, nheads_k, split_rows, heads, monkeypatch):
    """Several kv heads a tile (hd64, 256-row pages) halve while a split would stream fewer than
    HEADS_SPLIT_ROWS key rows (`split_rows` where given: the rule's outcomes on shapes a test can
    check), and each choice still computes the reference's answer. The counts are those of 132
    SMs (H100, H200); elsewhere the answer alone is checked."""
    import cupy
    from cupyflash import _kvcache
    plans = _results_of(monkeypatch, _kvcache, "_new_plan")
    monkeypatch.setattr(_kvcache._plan, "_plans", {})
    if split_rows:
        monkeypatch.setattr(_kvcache, "HEADS_SPLIT_ROWS", split_rows)
    rng = np.random.default_rng(capacity + batch + (split_rows or 0))
    case = _case(rng, "bfloat16", batch=batch, seqlen_q=1, seqlen_new=1, nheads=nheads, nheads_k=nheads_k,
                 capacity=capacity, headdim=64, rotary_dim=0, paged_page=256)
    case["cache_seqlens"][0] = capacity - 1  # a full cache after the append
    _run_and_check(case, "bfloat16", "cupy", causal=True)
    if cupy.cuda.Device().attributes["MultiProcessorCount"] == 132:
        assert _kv_heads_a_tile(plans) == [heads]


@pytest.mark.parametrize("headdim, nheads_k", [(64, 40), (128, 40)])
def test_pages_of_an_odd_multiple_of_16_rows(headdim, nheads_k):
    """48-row pages: hd64's 32-row key blocks (the few-CTA tile) end within a page or run their
    second 16 rows into the next page; hd128's 16-row blocks stay within one."""
    rng = np.random.default_rng(48 + headdim)
    case = _case(rng, "bfloat16", seqlen_q=2, seqlen_new=2, nheads=nheads_k, nheads_k=nheads_k, capacity=480,
                 headdim=headdim, paged_page=48)
    _run_and_check(case, "bfloat16", "cupy", causal=True)


def test_batch_index_leftpad_and_options():
    rng = np.random.default_rng(11)
    case = _case(rng, "bfloat16", batch=4, seqlen_q=2, seqlen_new=2, headdim=40, rotary_dim=40)
    spare = rng.standard_normal((2,) + case["k_cache"].shape[1:]).astype(bfloat16_dtype())
    case["k_cache"], case["v_cache"] = (np.concatenate([case[n], spare]) for n in ("k_cache", "v_cache"))
    options = dict(causal=True, window_size=(50, 0), softcap=2.0, cache_batch_idx=np.array([5, 0, 3, 1], np.int32),
                   cache_leftpad=np.minimum(case["cache_seqlens"], 7).astype(np.int32),
                   alibi_slopes=rng.uniform(0.01, 0.1, (4, 8)).astype(np.float32))
    _run_and_check(case, "bfloat16", "cupy", **options)


@pytest.mark.parametrize("headdim, seqlen_q, heads, dtype", [(64, 1, 4, "bfloat16"), (64, 2, 2, "bfloat16"),
                                                            (128, 1, 2, "bfloat16"), (64, 1, 4, "float16")])
def test_tiles_of_several_kv_heads_with_batch_index_leftpad_and_options(headdim, seqlen_q, heads, dtype, monkeypatch):
    """A long cache (past SHORT_CACHE), GQA 192/48: tiles of several kv heads, each row seeing its own
    head's keys through a window, softcap, ALiBi slopes per (batch, head), rotary, left padding and
    a batch index. (HEADS_SPLIT_ROWS lifted: the tiles take what decode_heads allows.)"""
    from cupyflash import _kvcache
    plans = _results_of(monkeypatch, _kvcache, "_new_plan")
    monkeypatch.setattr(_kvcache._plan, "_plans", {})
    monkeypatch.setattr(_kvcache, "HEADS_SPLIT_ROWS", 0)
    rng = np.random.default_rng(headdim + seqlen_q)
    case = _case(rng, dtype, batch=4, seqlen_q=seqlen_q, seqlen_new=seqlen_q, nheads=192, nheads_k=48,
                 headdim=headdim, capacity=4500, rotary_dim=headdim)
    spare = rng.standard_normal((2,) + case["k_cache"].shape[1:]).astype(case["k_cache"].dtype)
    case["k_cache"], case["v_cache"] = (np.concatenate([case[n], spare]) for n in ("k_cache", "v_cache"))
    case["cache_seqlens"][2] = 4500 - seqlen_q
    options = dict(causal=True, window_size=(700, 0), softcap=2.0, cache_batch_idx=np.array([5, 0, 3, 1], np.int32),
                   cache_leftpad=np.minimum(case["cache_seqlens"], 300).astype(np.int32),
                   alibi_slopes=rng.uniform(0.01, 0.1, (4, 192)).astype(np.float32))
    _run_and_check(case, dtype, "cupy", **options)
    assert set(_kv_heads_a_tile(plans)) == {heads}


@pytest.mark.parametrize("headdim,nheads,nheads_k,seqlen_q,num_splits,capacity", [
    (128, 32, 8, 1, 0, 5000),   # decode: GQA packed, the splits picked, a cache past SHORT_CACHE (the long-cache tile)
    (64, 192, 48, 1, 7, 6000),  # 144 CTAs of four kv heads, seven splits asked for
    (128, 32, 8, 4, 3, 1000),   # speculative rows, three splits asked for
    (256, 8, 1, 16, 0, 700),    # MQA: 128 packed rows, eight row blocks
    (40, 6, 6, 1, 0, 2048),     # MHA, a head dim padded to 64
    (64, 16, 2, 13, 1, 300),    # one split
    (64, 8, 1, 1, 8, 2048),     # eight splits: on sm_90 the largest cluster that merges its splits itself
    (96, 4, 2, 1, 200, 160),    # more splits asked for than key blocks
    (128, 8, 1, 1, 100, 4096),  # many splits for few rows: the combine's thread groups take several each
    # Short caches of more CTAs (3 x 48) than an H200 has SMs: the short-cache tiles (fewer take decode_few's)
    (64, 48, 48, 1, 0, 1000),
    (128, 96, 48, 2, 0, 4096),
])
def test_splits_groups_and_head_dims(headdim, nheads, nheads_k, seqlen_q, num_splits, capacity):
    rng = np.random.default_rng(headdim + seqlen_q)
    case = _case(rng, "bfloat16", batch=3, seqlen_q=seqlen_q, nheads=nheads, nheads_k=nheads_k, headdim=headdim,
                 capacity=capacity, seqlen_new=0, rotary_dim=0)
    case["cache_seqlens"][0] = 0  # a sequence without keys: out 0, lse -inf
    case["cache_seqlens"][1] = capacity
    _run_and_check(case, "bfloat16", "cupy", num_splits=num_splits)
    _run_and_check(case, "bfloat16", "cupy", num_splits=num_splits, causal=True, softcap=3.0)


def test_a_captured_decode_step_replays_with_new_lengths():
    """A decode step captured in a CUDA graph (CuPy stream capture) appends and attends at the
    lengths found on the device at each replay; every replay equals the same call made eagerly."""
    import cupy
    rng = np.random.default_rng(3)
    case = _case(rng, "bfloat16", batch=2, seqlen_q=1, seqlen_new=1, capacity=128, rotary_dim=0)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        arrays = {n: cupy.asarray(v) for n, v in case.items()}
        cupyflash.flash_attn_with_kvcache(**arrays, causal=True)  # plans, kernels and pool blocks outside the capture
        eager = {n: arrays[n].copy() for n in ("k_cache", "v_cache")}
        stream.synchronize()
        stream.begin_capture()
        out = cupyflash.flash_attn_with_kvcache(**arrays, causal=True)
        graph = stream.end_capture()
        for step in range(5):
            lengths = np.array([10 + step, 60 + 2 * step], np.int32)
            arrays["cache_seqlens"].set(lengths)
            graph.launch(stream)
            want = cupyflash.flash_attn_with_kvcache(
                arrays["q"], eager["k_cache"], eager["v_cache"], arrays["k"], arrays["v"],
                cache_seqlens=cupy.asarray(lengths), causal=True)
            stream.synchronize()
            assert bool((out == want).all()), f"replay {step}"
            assert bool((arrays["k_cache"] == eager["k_cache"]).all()), f"replay {step}: k_cache"


@pytest.mark.parametrize("num_splits", [1, 16])  # (16: more than a cluster holds, so the combine kernel merges)
def test_decode_steps_queued_back_to_back_read_what_the_step_before_wrote(num_splits):
    """Decode steps queued with no wait between them, as a serving loop queues them, each appending
    the step before's output as its new key and value and attending with it as q, equal the same
    steps each synchronised, bit for bit. On sm_90 a step's kernels are dependent launches, placed
    while the kernel before them runs: one that read or wrote before that kernel finished would
    see the step before's output unwritten (NaN: the pool is poisoned). One KV head over a long
    cache makes each step a long kernel of few CTAs, beside which the next one's find free SMs."""
    import cupy
    rng = np.random.default_rng(5)
    case = _case(rng, "bfloat16", batch=1, seqlen_q=1, nheads=1, nheads_k=1, headdim=128, capacity=16384,
                 seqlen_new=1, rotary_dim=0)
    case["cache_seqlens"] = np.array([16000], np.int32)  # every step appends at the same row

    def steps(synchronise):
        arrays = {n: cupy.asarray(v) for n, v in case.items()}
        x, outs = arrays.pop("q"), []
        for _ in range(8):
            x = cupyflash.flash_attn_with_kvcache(x, **dict(arrays, k=x, v=x), num_splits=num_splits)
            outs.append(x)
            if synchronise:
                cupy.cuda.Device().synchronize()
        cupy.cuda.Device().synchronize()
        return [cupy.asnumpy(o) for o in outs]

    with cupyflash.no_host_sync():
        steps(True)  # plans and kernels made before either run
        want, got = steps(True), steps(False)
    assert not any(np.isnan(np.asarray(o, np.float64)).any() for o in want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), f"step {i}"


# --------------------------------------------------------------------------------------------
# The frameworks' entry points on CUDA: the same kernels, so the core's CuPy results bit for bit.

def _torch_case(torch, seed=21):
    rng = np.random.default_rng(seed)
    case = _case(rng, "bfloat16", batch=2, seqlen_q=2, seqlen_new=2, capacity=96, rotary_dim=16, headdim=64)
    tensors = {n: torch.from_dlpack(__import__("cupy").asarray(v)) for n, v in case.items()}
    return case, tensors


def test_torch_dropin_eager_compiled_and_graph_replayed_match_the_core():
    import cupy
    torch = pytest.importorskip("torch")
    import cupyflash.torch as cft
    case, tensors = _torch_case(torch)
    arrays = {n: cupy.asarray(v) for n, v in case.items()}
    options = dict(causal=True, softcap=4.0, rotary_interleaved=False)
    want_out, want_lse = cupyflash.flash_attn_with_kvcache(**arrays, **options, return_softmax_lse=True)
    out, lse = cft.flash_attn_with_kvcache(**tensors, **options, return_softmax_lse=True)
    assert bool((cupy.from_dlpack(out) == want_out).all()) and bool((cupy.from_dlpack(lse) == want_lse).all())
    for name in ("k_cache", "v_cache"):
        assert bool((cupy.from_dlpack(tensors[name]) == arrays[name]).all()), name

    def step(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin):
        return cft.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                           **options) * 2
    torch._dynamo.reset()
    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "rotary_cos", "rotary_sin")
    _, fresh = _torch_case(torch)
    eager = {n: fresh[n].clone() for n in names}
    compiled = {n: fresh[n].clone() for n in names}
    want = step(**eager)
    got = torch.compile(step, fullgraph=True)(**compiled)
    assert torch.equal(got, want)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(compiled[name], eager[name])

    # torch.cuda.graph: a captured step replays with the lengths found on the device
    _, fresh = _torch_case(torch)
    graphed = {n: fresh[n].clone() for n in names}
    reference_caches = {n: fresh[n].clone() for n in ("k_cache", "v_cache")}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(**graphed)  # warm-up outside the capture: plans and kernels
    torch.cuda.current_stream().wait_stream(side)
    for n in ("k_cache", "v_cache"):
        graphed[n].copy_(fresh[n])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(**graphed)
    for replay, lengths in enumerate(([3, 50], [40, 7], [0, 94])):
        graphed["cache_seqlens"].copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        want = step(**{**graphed, "k_cache": reference_caches["k_cache"], "v_cache": reference_caches["v_cache"],
                       "cache_seqlens": torch.tensor(lengths, dtype=torch.int32, device="cuda")})
        torch.cuda.synchronize()
        assert torch.equal(captured, want), f"replay {replay}"
        assert torch.equal(graphed["k_cache"], reference_caches["k_cache"]), f"replay {replay}: k_cache"


def test_jax_under_jit_with_donated_caches_matches_the_core():
    import os
    import cupy
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import cupyflash.jax as cfj
    rng = np.random.default_rng(5)
    case = _case(rng, "bfloat16", batch=3, seqlen_q=1, seqlen_new=1, capacity=300, rotary_dim=32, headdim=128,
                 nheads=16, nheads_k=4, paged_page=16)
    arrays = {n: cupy.asarray(v) for n, v in case.items()}
    want_out, want_lse = cupyflash.flash_attn_with_kvcache(**arrays, causal=True, return_softmax_lse=True)

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def step(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, block_table):
        return cfj.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                           block_table=block_table, causal=True, return_softmax_lse=True)
    gpu = jax.devices("gpu")[0]
    args = [jax.device_put(jnp.asarray(case[n]), gpu) for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens",
                                                                "rotary_cos", "rotary_sin", "block_table")]
    out, lse, k_cache, v_cache = step(*args)
    np.testing.assert_array_equal(np.asarray(out).astype(np.float32), cupy.asnumpy(want_out).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(lse), cupy.asnumpy(want_lse))
    np.testing.assert_array_equal(np.asarray(k_cache).astype(np.float32), cupy.asnumpy(arrays["k_cache"]).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(v_cache).astype(np.float32), cupy.asnumpy(arrays["v_cache"]).astype(np.float32))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_varlen_prefill_from_a_paged_cache_on_the_gpu_equals_the_packed_call(dtype):
    """flash_attn_varlen_func with block_table on CuPy arrays (also under no_host_sync), and
    cupyflash.torch's on CUDA tensors with the gradients into the caches: the packed call's out and
    lse bitwise (the same kernels read the same keys), and (deterministic) the packed k and v's
    gradients at their pages and rows."""
    import cupy
    np_dtype = bfloat16_dtype() if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v, cu_q, cu_k, table, caches = paged_varlen_case(np.random.default_rng(6), 32)
    gpu = lambda x: cupy.asarray(np.asarray(x).astype(np_dtype) if x.dtype == np.float64 else x)  # noqa: E731
    q, k, v, cu_q, cu_k, table, k_cache, v_cache = map(gpu, (q, k, v, cu_q, cu_k, table, *caches))
    options = dict(causal=True, alibi_slopes=cupy.asarray([0.1, 0.2, 0.3, 0.4], cupy.float32), return_lse=True)
    want = cupyflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 33, **options)
    got = cupyflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 5, 33, block_table=table, **options)
    with cupyflash.no_host_sync():  # gathered on the device: nothing read on the host
        unread = cupyflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 5, 33, block_table=table, **options)
    for x, y, z in zip(got, want, unread):
        assert bool(cupy.isfinite(x).all()) and bool((x == y).all()) and bool((z == y).all())

    torch = pytest.importorskip("torch")
    import cupyflash.torch as cft
    t = lambda x, grad=False: torch.from_dlpack(x).clone().requires_grad_(grad)  # noqa: E731
    dout = torch.randn(tuple(q.shape), dtype=getattr(torch, dtype), device="cuda")
    packed = [t(x, True) for x in (q, k, v)]
    out = cft.flash_attn_varlen_func(*packed, t(cu_q), t(cu_k), 5, 33, causal=True, deterministic=True)
    out.backward(dout)
    paged = [t(x, True) for x in (q, k_cache, v_cache)]
    out_paged = cft.flash_attn_varlen_func(*paged[:3], t(cu_q), t(cu_k), 5, 33, causal=True, deterministic=True,
                                           block_table=t(table))
    out_paged.backward(dout)
    assert torch.equal(out_paged, out) and torch.equal(paged[0].grad, packed[0].grad)
    cu, pages, page = cupy.asnumpy(cu_k), cupy.asnumpy(table), k_cache.shape[1]
    for cache, grad in ((paged[1], packed[1].grad), (paged[2], packed[2].grad)):
        expected = torch.zeros_like(cache)
        for b in range(len(cu) - 1):
            positions = np.arange(cu[b + 1] - cu[b])
            expected[pages[b, positions // page], positions % page] = grad[int(cu[b]):int(cu[b + 1])]
        assert torch.equal(cache.grad, expected)



def test_jax_varlen_prefill_from_a_paged_cache_under_jit_equals_the_packed_call():
    """cupyflash.jax.flash_attn_varlen with block_table (the keys gathered on the device, extra key-only
    sequences after the last) under jit: the packed call's out and dq bitwise (deterministic), and
    the packed k and v's gradients at their pages and rows of the caches."""
    import os
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import cupyflash.jax as cfj
    q, k, v, cu_q, cu_k, table, caches = paged_varlen_case(np.random.default_rng(8), 32)
    gpu = jax.devices("gpu")[0]
    put = lambda x: jax.device_put(jnp.asarray(x, jnp.bfloat16 if x.dtype == np.float64 else x.dtype), gpu)  # noqa: E731
    q, k, v, cu_q, cu_k, table, k_cache, v_cache = map(put, (q, k, v, cu_q, cu_k, table, *caches))
    dout = put(np.random.default_rng(9).standard_normal(q.shape))

    def step(q, k, v, block_table=None):
        attention = lambda q, k, v: cfj.flash_attn_varlen(q, k, v, cu_q, cu_k, 5, 33, causal=True,  # noqa: E731
                                                          deterministic=True, block_table=block_table)
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(dout)
    out, (dq, dk, dv) = jax.jit(step)(q, k, v)
    out_paged, (dq_paged, dk_cache, dv_cache) = jax.jit(step)(q, k_cache, v_cache, table)
    assert bool(jnp.isfinite(out).all())
    np.testing.assert_array_equal(np.asarray(out_paged, np.float32), np.asarray(out, np.float32))
    np.testing.assert_array_equal(np.asarray(dq_paged, np.float32), np.asarray(dq, np.float32))
    cu, pages, page = np.asarray(cu_k), np.asarray(table), k_cache.shape[1]
    for got, grad in ((dk_cache, dk), (dv_cache, dv)):
        expected = np.zeros(got.shape, np.float32)
        for b in range(len(cu) - 1):
            positions = np.arange(cu[b + 1] - cu[b])
            expected[pages[b, positions // page], positions % page] = np.asarray(grad, np.float32)[cu[b]:cu[b + 1]]
        np.testing.assert_array_equal(np.asarray(got, np.float32), expected)


def test_torch_varlen_prefill_from_a_paged_cache_captures_and_replays_with_new_lengths_and_tables():
    """cupyflash.torch's paged varlen gathers on the device with no host read, so it captures in a CUDA
    graph; replays with other lengths and block tables copied into the captured tensors give the
    eager call's out bitwise."""
    torch = pytest.importorskip("torch")
    import cupyflash.torch as cft
    q, _, _, cu_q, cu_k, table, caches = paged_varlen_case(np.random.default_rng(10), 32)
    t = lambda x: torch.from_numpy(np.asarray(x)).to("cuda", torch.bfloat16 if x.dtype == np.float64 else None)  # noqa: E731
    q, cu_q, cu_k, table, k_cache, v_cache = map(t, (q, cu_q, cu_k, table, *caches))
    attention = lambda: cft.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 5, 33, causal=True,  # noqa: E731
                                                   block_table=table)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention()
    for lengths, order in (((20, 7, 33), [0, 1, 2]), ((33, 0, 1), [2, 0, 1]), ((1, 32, 17), [1, 2, 0])):
        new_cu, new_table = torch.tensor(np.cumsum((0,) + lengths), dtype=torch.int32), table[order].clone()
        cu_k.copy_(new_cu)
        table.copy_(new_table)
        graph.replay()
        torch.cuda.synchronize()
        want = attention()
        assert bool(torch.isfinite(want).all()) and torch.equal(captured, want), lengths


def test_an_odd_batch_of_long_caches_spreads_its_splits_over_whole_waves(monkeypatch):
    """17 sequences x 8 KV heads are 136 CTAs: past a wave of the long-cache tile's one CTA per SM on
    an H200 (132) by four, which the split rule spreads over whole waves of splits (_kvcache.splits)
    merged by the combine. The result is checked; on 132 SMs, that the rule split it."""
    import cupy
    from cupyflash import _kvcache
    picked = _results_of(monkeypatch, _kvcache, "splits")
    rng = np.random.default_rng(17)
    case = _case(rng, "bfloat16", batch=17, nheads=32, nheads_k=8, headdim=128, capacity=8320, seqlen_new=0,
                 rotary_dim=0)
    case["cache_seqlens"][:] = 8320
    case["cache_seqlens"][3] = 0      # a sequence without keys: its splits weigh nothing
    case["cache_seqlens"][5] = 4000   # a shorter one: its later splits see no key
    _run_and_check(case, "bfloat16", "cupy")
    assert picked
    if cupy.cuda.Device().attributes["MultiProcessorCount"] == 132:
        assert picked[-1] > 1
