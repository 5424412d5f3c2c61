"""flash_attn_with_kvcache on the NumPy path (CPU): the append into the caches (in place, dense and
paged), rotary (interleaved and half-split, on keys and queries at their positions), cache_batch_idx,
cache_leftpad, GQA and the options, against a naive float64 attention written here from the
documented semantics; and the argument checks, each error naming its argument."""

import numpy as np
import pytest

import cupyflash
from cupyflash._arrays import bfloat16_dtype
from reference_helpers import paged_varlen_case, paged_varlen_refusals

RNG_SEED = 21


def _rotated(x, cos, sin, positions, interleaved):
    """x (seqlen, nheads, headdim) with pairs of its first 2 * cos.shape[1] dims multiplied, as
    complex numbers, by cos + i sin at each row's position."""
    x = np.array(x, np.float64)
    half = cos.shape[1]
    if interleaved:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        first, second = slice(0, half), slice(half, 2 * half)
    turn = (np.asarray(cos, np.float64) + 1j * np.asarray(sin, np.float64))[positions][:, None, :]
    pairs = (x[..., first] + 1j * x[..., second]) * turn
    x[..., first], x[..., second] = pairs.real, pairs.imag
    return x


def _attention(q, k, v, scale, causal, window, softcap, slopes):
    """Naive attention of one sequence: q (sq, h, d), k and v (sk, hk, d) in float64; (out, lse)."""
    sq, h, d = q.shape
    sk, hk = k.shape[:2]
    out, lse = np.zeros((sq, h, d)), np.full((h, sq), -np.inf)
    for head in range(h):
        kv = head // (h // hk)
        s = q[:, head] @ k[:, kv].T * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
        diagonal = i + sk - sq
        if slopes is not None:
            s = s - slopes[head] * np.abs(diagonal - j)
        left, right = window
        seen = np.ones((sq, sk), bool)
        if causal:
            seen &= j <= diagonal
        if left >= 0:
            seen &= j >= diagonal - left
        if right >= 0:
            seen &= j <= diagonal + right
        s = np.where(seen, s, -np.inf)
        for row in range(sq):
            if seen[row].any():
                m = s[row].max()
                e = np.exp(s[row] - m)
                out[row, head] = e @ v[:, kv] / e.sum()
                lse[head, row] = m + np.log(e.sum())
    return out, lse


def _expected(q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad, interleaved, scale, causal,
              window, softcap, alibi):
    """(out, lse, k_cache, v_cache after the append) from the documented semantics, on dense caches."""
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    batch, sq, h, d = q.shape
    out, lse = np.zeros(q.shape), np.zeros((batch, h, sq))
    local = causal or tuple(window) != (-1, -1)
    for b in range(batch):
        row = b if batch_idx is None else batch_idx[b]
        start = 0 if leftpad is None else leftpad[b]
        length = int(seqlens[b])
        qb = np.asarray(q[b], np.float64)
        if k is not None:
            new = np.arange(length, length + k.shape[1])
            kb = k[b]
            if cos is not None:
                kb = _rotated(kb, cos, sin, new, interleaved)
                qb = _rotated(qb, cos, sin, length + (np.arange(sq) if local else np.zeros(sq, int)), interleaved)
            k_cache[row, new] = np.asarray(kb, np.float64).astype(k_cache.dtype)
            v_cache[row, new] = v[b]
            length += k.shape[1]
        keys = slice(start, length)
        slopes = None if alibi is None else (alibi[b] if alibi.ndim == 2 else alibi)
        out[b], lse[b] = _attention(qb, np.asarray(k_cache[row, keys], np.float64),
                                    np.asarray(v_cache[row, keys], np.float64), scale, causal, window, softcap, slopes)
    return out, lse, k_cache, v_cache


def _case(batch=3, seqlen_q=1, nheads=4, nheads_k=2, headdim=40, capacity=70, seqlen_new=None, rotary_dim=0,
          dtype=np.float64, seed=RNG_SEED):
    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    case = dict(q=draw(batch, seqlen_q, nheads, headdim), k_cache=draw(batch, capacity, nheads_k, headdim),
                v_cache=draw(batch, capacity, nheads_k, headdim))
    new = seqlen_q if seqlen_new is None else seqlen_new
    if new:
        case.update(k=draw(batch, new, nheads_k, headdim), v=draw(batch, new, nheads_k, headdim))
    longest = capacity - new
    case["cache_seqlens"] = rng.integers(0, longest + 1, batch).astype(np.int32)
    if rotary_dim:
        angles = rng.uniform(0, 2 * np.pi, (capacity + seqlen_q, rotary_dim // 2))
        case.update(rotary_cos=np.cos(angles).astype(dtype), rotary_sin=np.sin(angles).astype(dtype))
    return case, rng


def _check(case, **options):
    """Runs flash_attn_with_kvcache on copies of the case's caches, compares out, lse and the caches
    after the append with _expected, and returns them."""
    got_k, got_v = case["k_cache"].copy(), case["v_cache"].copy()
    args = {name: value for name, value in case.items() if name not in ("k_cache", "v_cache")}
    out, lse = cupyflash.flash_attn_with_kvcache(k_cache=got_k, v_cache=got_v, return_softmax_lse=True, **args,
                                                 **options)
    headdim = case["q"].shape[-1]
    scale = options.get("softmax_scale") or headdim ** -0.5
    want = _expected(case["q"], case["k_cache"], case["v_cache"], case.get("k"), case.get("v"),
                     case.get("rotary_cos"), case.get("rotary_sin"), np.broadcast_to(case["cache_seqlens"],
                                                                                     case["q"].shape[:1]),
                     options.get("cache_batch_idx"), options.get("cache_leftpad"),
                     options.get("rotary_interleaved", True), scale, options.get("causal", False),
                     options.get("window_size", (-1, -1)), options.get("softcap", 0.0), options.get("alibi_slopes"))
    exact = case["q"].dtype == np.float64
    tolerance = 1e-10 if exact else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float64), want[0], atol=tolerance, rtol=tolerance)
    np.testing.assert_allclose(lse, want[1], atol=tolerance, rtol=tolerance)
    # The caches: what was appended (rotated in float64 two ways, then rounded to the cache's dtype:
    # a last-place difference either way), and every other row exactly.
    unit = 1e-14 if exact else 2.0 ** -8
    appended = np.zeros(got_k.shape[:2], bool)
    if case.get("k") is not None:
        for b, length in enumerate(np.broadcast_to(case["cache_seqlens"], case["q"].shape[:1])):
            row = b if options.get("cache_batch_idx") is None else options["cache_batch_idx"][b]
            appended[row, length:length + case["k"].shape[1]] = True
    for name, got, expected in zip(("k_cache", "v_cache"), (got_k, got_v), want[2:]):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(expected, np.float64), rtol=unit, atol=unit)
        assert np.array_equal(got[~appended], case[name][~appended]), f"{name}: a row that was not appended changed"
    return out, lse, got_k, got_v


@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 0), (1, 1), (4, 4), (16, 16), (33, 33), (3, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_append_and_attend_against_naive(seqlen_q, seqlen_new, causal):
    """Decode (seqlen_q 1), speculative (4, 16), chunked prefill (33) and more new keys than queries,
    with GQA and per-sequence lengths; the cache rows past the new tokens are left alone."""
    case, _ = _case(seqlen_q=seqlen_q, seqlen_new=seqlen_new)
    _check(case, causal=causal)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [40, 16, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary_on_new_keys_and_queries(interleaved, rotary_dim, causal):
    """GPT-J (interleaved) and GPT-NeoX (half-split) rotary over all or part of the head dim; q turns
    at cache_seqlens + i when causal, all at cache_seqlens otherwise."""
    case, _ = _case(seqlen_q=4, rotary_dim=rotary_dim)
    _check(case, causal=causal, rotary_interleaved=interleaved)


def test_rotary_with_a_window_turns_queries_at_their_positions():
    case, _ = _case(seqlen_q=5, rotary_dim=8)
    _check(case, window_size=(6, 2))


@pytest.mark.parametrize("options", [dict(window_size=(7, 0)), dict(window_size=(3, 2), causal=False),
                                     dict(softcap=1.5, causal=True), dict(softmax_scale=0.3),
                                     dict(alibi_slopes="heads", causal=True), dict(alibi_slopes="batch")])
def test_options(options):
    case, rng = _case(seqlen_q=6)
    options = dict(options)
    if options.get("alibi_slopes") == "heads":
        options["alibi_slopes"] = rng.uniform(0.1, 0.6, 4).astype(np.float64)
    elif options.get("alibi_slopes") == "batch":
        options["alibi_slopes"] = rng.uniform(0.1, 0.6, (3, 4)).astype(np.float64)
    _check(case, **options)


def test_cache_batch_idx_and_leftpad():
    """Batch entries read and write cache rows given by cache_batch_idx (of a cache with spare rows),
    and attend from cache_leftpad on: positions, masks and ALiBi count from there."""
    case, rng = _case(seqlen_q=2, rotary_dim=8)
    spare = rng.standard_normal((2,) + case["k_cache"].shape[1:])
    case["k_cache"] = np.concatenate([case["k_cache"], spare])
    case["v_cache"] = np.concatenate([case["v_cache"], spare + 1])
    index = np.array([4, 0, 2], np.int32)
    leftpad = np.minimum(case["cache_seqlens"], np.array([3, 0, 9])).astype(np.int32)
    out, _, k_cache, _ = _check(case, causal=True, cache_batch_idx=index, cache_leftpad=leftpad,
                                alibi_slopes=np.full(4, 0.25))
    untouched = [1, 3]
    assert np.array_equal(k_cache[untouched], case["k_cache"][untouched])


@pytest.mark.parametrize("page_size", [16, 32])
def test_a_paged_cache_gives_the_dense_results(page_size):
    """The same sequences in a paged cache (pages shuffled among spare blocks through block_table) give
    the dense cache's out and lse, and the append lands in the right page rows."""
    case, rng = _case(seqlen_q=3, capacity=4 * page_size, rotary_dim=8)
    batch, capacity, nheads_k, headdim = case["k_cache"].shape
    pages = capacity // page_size
    blocks = batch * pages + 5
    table = rng.permutation(blocks)[:batch * pages].reshape(batch, pages).astype(np.int32)
    paged = {}
    for name in ("k_cache", "v_cache"):
        store = rng.standard_normal((blocks, page_size, nheads_k, headdim))
        store[table] = case[name].reshape(batch, pages, page_size, nheads_k, headdim)
        paged[name] = store
    dense = _check(case, causal=True)
    args = {name: value for name, value in case.items() if name not in ("k_cache", "v_cache")}
    out, lse = cupyflash.flash_attn_with_kvcache(**paged, **args, block_table=table, causal=True,
                                                 return_softmax_lse=True)
    np.testing.assert_array_equal(out, dense[0])
    np.testing.assert_array_equal(lse, dense[1])
    for name, cache in zip(("k_cache", "v_cache"), dense[2:]):
        assert np.array_equal(paged[name][table].reshape(cache.shape), cache)


def test_an_int_length_an_empty_sequence_and_a_full_cache():
    case, _ = _case(seqlen_q=2, seqlen_new=0)
    case["cache_seqlens"] = np.array([0, 5, 70], np.int32)
    out, lse, _, _ = _check(case, causal=True)
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()  # no key: out 0, lse -inf
    case, _ = _case(seqlen_q=2)
    case["cache_seqlens"] = 11
    _check(case)
    case, _ = _case(seqlen_q=2, seqlen_new=0)
    del case["cache_seqlens"]  # the whole cache
    _check(dict(case, cache_seqlens=np.full(3, 70, np.int32)))
    full = cupyflash.flash_attn_with_kvcache(case["q"], case["k_cache"], case["v_cache"])
    np.testing.assert_array_equal(full, cupyflash.flash_attn_with_kvcache(
        case["q"], case["k_cache"], case["v_cache"], cache_seqlens=70))
    for length in (np.int32(70), np.int64(70)):  # a NumPy integer is an int, as in the drop-ins
        np.testing.assert_array_equal(full, cupyflash.flash_attn_with_kvcache(
            case["q"], case["k_cache"], case["v_cache"], cache_seqlens=length))


def test_low_precision_caches_hold_the_rounded_appended_keys():
    """bfloat16 arrays: the appended (rotated) keys land in the cache rounded to bfloat16, and the
    attention reads them from there; the result comes back in q's dtype."""
    case, _ = _case(seqlen_q=2, rotary_dim=8, dtype=bfloat16_dtype())
    out, _, _, _ = _check(case, causal=True)
    assert out.dtype == bfloat16_dtype()


# --------------------------------------------------------------------------------------------
# Bad input: a clear exception naming the argument.

def _bad(case, error, match, **changes):
    args = dict(case)
    args.update(changes)
    for name in [n for n, value in changes.items() if value is None]:
        args[name] = None
    with pytest.raises(error, match=match):
        cupyflash.flash_attn_with_kvcache(**args)


def test_bad_input_names_the_argument():
    case, rng = _case(seqlen_q=2, rotary_dim=8)
    f64 = np.float64
    _bad(case, ValueError, "exceed the cache", cache_seqlens=np.array([0, 69, 3], np.int32))
    _bad(case, ValueError, "exceed the cache", cache_seqlens=69)
    _bad(case, ValueError, "cache_seqlens must be >= 0", cache_seqlens=np.array([0, -1, 3], np.int32))
    _bad(case, ValueError, "cache_seqlens must be >= 0", cache_seqlens=-2)
    _bad(case, TypeError, "cache_seqlens must be an int32 array", cache_seqlens=np.zeros(3, np.int64))
    _bad(case, ValueError, r"cache_seqlens must have shape \(batch,\)", cache_seqlens=np.zeros(4, np.int32))
    _bad(case, TypeError, "cache_seqlens must be an int or", cache_seqlens=2.0)
    _bad(case, ValueError, "k_cache and v_cache must have the same shape", v_cache=case["v_cache"][:, :60])
    _bad(case, TypeError, "k_cache has dtype float32", k_cache=case["k_cache"].astype(np.float32))
    _bad(case, ValueError, "k_cache has head dim", k_cache=case["k_cache"][..., :32], v_cache=case["v_cache"][..., :32])
    _bad(case, ValueError, "multiple of k_cache's nheads", k_cache=case["k_cache"][:, :, :1].repeat(3, 2),
         v_cache=case["v_cache"][:, :, :1].repeat(3, 2))
    _bad(case, ValueError, "k_cache has 2 rows", k_cache=case["k_cache"][:2], v_cache=case["v_cache"][:2])
    _bad(case, ValueError, "k and v come together", v=None)
    _bad(case, ValueError, "k and v must have shape", k=case["k"][:, :, :1], v=case["v"][:, :, :1])
    _bad(case, TypeError, "k has dtype", k=case["k"].astype(np.float32))
    _bad(case, ValueError, "rotary_cos and rotary_sin come together", rotary_sin=None)
    _bad(case, TypeError, "rotary_cos and rotary_sin must have one dtype, got float64 and float32",
         rotary_sin=case["rotary_sin"].astype(np.float32))
    _bad(case, ValueError, "rotary_cos and rotary_sin have 2 rows", rotary_cos=case["rotary_cos"][:2],
         rotary_sin=case["rotary_sin"][:2])
    _bad(case, ValueError, r"rotary_cos must be 2-D \(seqlen_ro, rotary_dim / 2\)",
         rotary_cos=np.ones((80, 21), f64), rotary_sin=np.ones((80, 21), f64))
    _bad(case, ValueError, "they need k and v", k=None, v=None)
    _bad(case, ValueError, "k and v are appended at cache_seqlens", cache_seqlens=None)
    _bad(case, ValueError, "cache_batch_idx must index k_cache's 3 rows", cache_batch_idx=np.array([0, 3, 1], np.int32))
    _bad(case, TypeError, "cache_batch_idx must be a CuPy, PyTorch or JAX array", cache_batch_idx=[0, 1, 2])
    _bad(case, ValueError, r"cache_leftpad must be in \[0, cache_seqlens\]",
         cache_leftpad=case["cache_seqlens"] + np.int32(1))
    _bad(case, TypeError, "rotary_interleaved must be a bool", rotary_interleaved=1)
    _bad(case, ValueError, "num_splits must be an int >= 0", num_splits=-1)
    _bad(case, TypeError, "q must be a CuPy, PyTorch or JAX array", q=[1.0])
    _bad(case, ValueError, "window_size", window_size=(1, 2, 3))
    _bad(case, ValueError, "softcap", softcap=-1.0)
    _bad(case, ValueError, "alibi_slopes must have shape", alibi_slopes=np.ones(3, np.float64))


def test_bad_paged_input_names_the_argument():
    case, rng = _case(seqlen_q=1, capacity=32)
    paged = dict(case, k_cache=case["k_cache"].reshape(6, 16, 2, 40), v_cache=case["v_cache"].reshape(6, 16, 2, 40),
                 block_table=np.arange(6, dtype=np.int32).reshape(3, 2))
    cupyflash.flash_attn_with_kvcache(**paged)
    _bad(paged, TypeError, "block_table must be an int32 array", block_table=paged["block_table"].astype(np.int64))
    _bad(paged, ValueError, r"block_table must have shape \(batch, pages per sequence\)",
         block_table=paged["block_table"][:2])
    _bad(paged, ValueError, r"block_table\[1, 0\] = 9 is not a block", block_table=np.array([[0, 1], [9, 3], [4, 5]],
                                                                                            np.int32))
    _bad(paged, ValueError, "page size .* multiple of 16", k_cache=case["k_cache"].reshape(12, 8, 2, 40),
         v_cache=case["v_cache"].reshape(12, 8, 2, 40))
    _bad(paged, ValueError, "cache_leftpad does not combine with block_table", cache_leftpad=np.zeros(3, np.int32))
    _bad(paged, ValueError, "cache_batch_idx does not combine with block_table",
         cache_batch_idx=np.arange(3, dtype=np.int32))


# --------------------------------------------------------------------------------------------
# flash_attn_varlen_func with block_table: prefill from a paged cache.

@pytest.mark.parametrize("page", [16, 32])
def test_varlen_prefill_from_a_paged_cache_equals_the_packed_call(page):
    """Sequences of 20, 7 and 33 keys (queries 3, 0, 5) in shuffled pages give the packed call's out
    and lse exactly."""
    q, k, v, cu_q, cu_k, table, (k_cache, v_cache) = paged_varlen_case(np.random.default_rng(4), page)
    options = dict(causal=True, softcap=2.0, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]), return_lse=True)
    want = cupyflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 33, **options)
    got = cupyflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 5, 33, block_table=table, **options)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("longest", [33, 40, 1000])
def test_the_device_gather_of_a_paged_cache_packs_the_host_gathers_rows_then_key_only_sequences(longest):
    """_paged.packed_from_pages (run here with NumPy, as the GPU paths run it with CuPy, jax.numpy and
    torch): the first rows are paged_rows' keys, the rest extra sequences of at most max_seqlen_k
    keys and no queries, whose call gives the exact packing's out and lse (ALiBi per sequence)."""
    from cupyflash import _paged
    from cupyflash.validate import Varlen
    q, k, v, cu_q, cu_k, table, (k_cache, v_cache) = paged_varlen_case(np.random.default_rng(6))
    slopes = np.random.default_rng(7).uniform(0.05, 0.5, (3, 4))
    pk, pv, pcu_q, pcu_k, pslopes = _paged.packed_from_pages(np, k_cache, v_cache, Varlen(cu_q, cu_k, 5, longest), table,
                                                             slopes)
    rows = table.size * k_cache.shape[1]
    assert pk.shape == (rows, 2, 16) and pcu_k[-1] == rows and (np.diff(pcu_k) <= longest).all()
    np.testing.assert_array_equal(pcu_k[:4], cu_k)
    np.testing.assert_array_equal(pcu_q, np.concatenate([cu_q, np.full(len(pcu_q) - 4, cu_q[-1])]))
    np.testing.assert_array_equal(pslopes, np.concatenate([slopes, np.zeros((len(pcu_q) - 4, 4))]))
    np.testing.assert_array_equal(pk[:60], k)
    np.testing.assert_array_equal(pv[:60], v)
    want = cupyflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 33, causal=True, alibi_slopes=slopes,
                                            return_lse=True)
    got = cupyflash.flash_attn_varlen_func(q, pk, pv, pcu_q, pcu_k, 5, longest, causal=True, alibi_slopes=pslopes,
                                           return_lse=True)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


def test_the_device_gather_agrees_across_array_modules_on_random_packings():
    """Random packings (empty sequences, all of them empty, slack in max_seqlen_k and in the table):
    the gather in NumPy gives the exact call's out and lse, and in torch and jax.numpy (where
    installed) the same packed arrays as in NumPy."""
    from cupyflash import _paged
    from cupyflash.validate import Varlen
    modules = [("numpy", np, np.asarray, np.asarray)]
    try:
        import torch
        modules.append(("torch", _paged.TorchCalls("cpu"), torch.from_numpy, lambda x: x.numpy()))
    except ImportError:
        pass
    try:
        import jax
        import jax.numpy as jnp
        cpu = jax.devices("cpu")[0]
        modules.append(("jax", jnp, lambda x: jax.device_put(jnp.asarray(x), cpu), np.asarray))
    except ImportError:
        pass
    rng = np.random.default_rng(11)
    for trial in range(30):
        batch, page = int(rng.integers(1, 5)), int(rng.choice([16, 32]))
        lengths_k = np.where(rng.random(batch) < 0.3, 0, rng.integers(0, 70, batch))
        lengths_q = rng.integers(0, 6, batch)
        pages = max(1, -(-int(lengths_k.max()) // page)) + int(rng.integers(0, 2))
        blocks = batch * pages + int(rng.integers(0, 4))
        table = rng.permutation(blocks)[:batch * pages].reshape(batch, pages).astype(np.int32)
        k_cache, v_cache = (rng.standard_normal((blocks, page, 2, 8)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((int(lengths_q.sum()), 4, 8)).astype(np.float32)
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
        max_q, max_k = int(lengths_q.max()), int(lengths_k.max()) + int(rng.integers(0, 5))
        slopes = rng.uniform(0.05, 0.5, (batch, 4)).astype(np.float32)
        packed = {}
        for name, xp, to, back in modules:
            got = _paged.packed_from_pages(xp, to(k_cache), to(v_cache), Varlen(to(cu_q), to(cu_k), max_q, max_k),
                                           to(table), to(slopes))
            packed[name] = [back(x) for x in got]
            for what, x, y in zip(("k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes"), packed[name],
                                  packed["numpy"]):
                np.testing.assert_array_equal(x, y, err_msg=f"trial {trial}: {name} {what}")
        k, v, pcu_q, pcu_k, pslopes = packed["numpy"]
        want = cupyflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, block_table=table,
                                                causal=True, alibi_slopes=slopes, return_lse=True)
        got = cupyflash.flash_attn_varlen_func(q, k, v, pcu_q, pcu_k, max_q, max_k, causal=True, alibi_slopes=pslopes,
                                               return_lse=True)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y, err_msg=f"trial {trial}")


def test_bad_paged_varlen_input_names_the_argument():
    q, k, v, cu_q, cu_k, table, (k_cache, v_cache) = paged_varlen_case(np.random.default_rng(5))
    arguments = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=33,
                     block_table=table)
    for changes, error, message in paged_varlen_refusals(table, k_cache, v_cache):
        with pytest.raises(error, match=message):
            cupyflash.flash_attn_varlen_func(**dict(arguments, **changes))


# --------------------------------------------------------------------------------------------
# The GPU path's host arithmetic (cupyflash/_kvcache.py): the key splits of a decode launch.

def test_decode_streaming_slots_by_cache_length():
    from cupyflash._config import SHORT_CACHE
    from cupyflash._kvcache import streaming_slots
    # 132 SMs (the H200): short dense caches stream on one CTA per SM of the 6- and 8-warp tiles,
    # two of the 4-warp one (fewer where fewer are resident); longer dense ones on every resident CTA,
    # longer paged ones on up to two an SM
    assert streaming_slots(warps=8, sms=132, resident=264, capacity=SHORT_CACHE, paged=False) == 132
    assert streaming_slots(warps=6, sms=132, resident=396, capacity=1024, paged=False) == 132
    assert streaming_slots(warps=4, sms=132, resident=528, capacity=1024, paged=False) == 264
    assert streaming_slots(warps=4, sms=132, resident=132, capacity=1024, paged=False) == 132
    assert streaming_slots(warps=6, sms=132, resident=396, capacity=SHORT_CACHE + 16, paged=False) == 396
    assert streaming_slots(warps=8, sms=132, resident=132, capacity=131072, paged=False) == 132
    assert streaming_slots(warps=6, sms=132, resident=396, capacity=SHORT_CACHE // 4, paged=True) == 132
    assert streaming_slots(warps=6, sms=132, resident=396, capacity=SHORT_CACHE, paged=True) == 264
    assert streaming_slots(warps=4, sms=132, resident=660, capacity=131072, paged=True) == 264
    assert streaming_slots(warps=4, sms=132, resident=660, capacity=131072, paged=False) == 660
    assert streaming_slots(warps=6, sms=132, resident=264, capacity=131072, paged=True) == 264


def test_a_long_cache_tile_takes_the_kv_heads_whose_rows_fit_it_and_a_copy_step():
    from cupyflash._config import Tile
    from cupyflash._kvcache import decode_heads
    assert [Tile(hd, 16, 16, 8, 2).decode_copy_rows for hd in (32, 64, 96, 128, 160, 256)] == [1, 4, 1, 2, 1, 1]

    def heads(nheads_k, rows_per_head, copy_rows=4, table="decode", capacity=65536):
        return decode_heads(table, nheads_k, rows_per_head, 16, copy_rows, capacity)
    assert heads(nheads_k=8, rows_per_head=4) == 4                  # hd64 GQA 32/8, one query row
    assert heads(nheads_k=8, rows_per_head=4, copy_rows=2) == 2     # hd128: a step's two rows
    assert heads(nheads_k=8, rows_per_head=8) == 2                  # 64/8, or 32/8 with two rows
    assert heads(nheads_k=4, rows_per_head=7) == 2                  # 28/4: 14 of 16 rows
    assert heads(nheads_k=32, rows_per_head=1) == 4                 # MHA
    assert heads(nheads_k=6, rows_per_head=1) == 2                  # powers of two dividing nheads_k
    assert heads(nheads_k=1, rows_per_head=1) == 1                  # MQA
    assert heads(nheads_k=8, rows_per_head=9) == 1                  # rows of one head past half a tile
    assert heads(nheads_k=8, rows_per_head=64) == 1                 # chunked prefill
    assert heads(nheads_k=8, rows_per_head=1, copy_rows=1) == 1     # hd256, unswizzled head dims
    for table in ("decode_small", "decode_few"):                    # short caches, small pages, a CTA an SM
        assert heads(nheads_k=8, rows_per_head=4, table=table) == 1
    assert heads(nheads_k=8, rows_per_head=4, capacity=2 ** 28) == 4  # virtual rows up to 2^30 (a long block table)
    assert heads(nheads_k=8, rows_per_head=4, capacity=2 ** 28 + 1) == 2
    assert heads(nheads_k=8, rows_per_head=4, capacity=2 ** 29 + 1) == 1


def test_decode_splits_fill_the_slots_in_one_wave_with_no_empty_split():
    from cupyflash._kvcache import MAX_SPLITS, splits
    # sms=132: the H200; slots of 264 or 396 are two or three CTAs per SM
    assert splits(ctas=128, key_blocks=1024, warps=8, slots=132, sms=132) == 1  # 97% of the slots: no split
    assert splits(ctas=128, key_blocks=64, warps=6, slots=132, sms=132) == 1    # (v41: one split 20.9 us, two 28.3)
    assert splits(ctas=128, key_blocks=4096, warps=6, slots=396, sms=132) == 3  # a long paged cache
    assert splits(ctas=1024, key_blocks=64, warps=4, slots=264, sms=132) == 1
    assert splits(ctas=64, key_blocks=64, warps=4, slots=264, sms=132) == 4     # 16 blocks a split
    assert splits(ctas=16, key_blocks=4096, warps=8, slots=132, sms=132) == 8   # 128 CTAs (v42: 9, 144, read at half speed)
    assert splits(ctas=3, key_blocks=4096, warps=8, slots=132, sms=132) == 43   # 44 asked: 94 -> 96 blocks each -> 43
    assert splits(ctas=8, key_blocks=256, warps=4, slots=264, sms=132) == 32    # 33 asked: 8 blocks each -> 32 splits
    assert splits(ctas=4, key_blocks=256, warps=6, slots=132, sms=132) == 22    # 33 asked: 8 -> 12 blocks each -> 22
    assert splits(ctas=1, key_blocks=256, warps=6, slots=132, sms=132) == 43    # one block per warp and split
    assert splits(ctas=8, key_blocks=8, warps=4, slots=264, sms=132) == 2
    assert splits(ctas=1, key_blocks=10 ** 6, warps=8, slots=132, sms=132) == MAX_SPLITS
    for slots in (46, 108, 132, 264, 528):
        for warps in (4, 6, 8):
            for ctas in (1, 3, 8, 64, 100, 200, 1000):
                for key_blocks in (1, 5, 64, 255, 4096, 10 ** 6):
                    count = splits(ctas, key_blocks, warps, slots, sms=132)
                    assert 1 <= count <= min(MAX_SPLITS, max(1, -(-key_blocks // warps)))
                    blocks_per_split = -(-key_blocks // count)
                    per_split = -(-blocks_per_split // warps) * warps  # flash_decode's share of a split
                    assert (count - 1) * per_split < key_blocks <= count * per_split  # every split gets keys
                    if slots > 132 or key_blocks <= 63 * warps:  # several CTAs a SM, or short streams (64 steps)
                        if ctas >= 0.8 * slots:
                            assert count == 1
                        else:  # one wave: no SM streams two CTAs' keys
                            assert ctas * count <= slots


def test_decode_splits_spread_long_streams_over_whole_waves_of_one_cta_per_sm():
    from cupyflash._kvcache import _splits_with_keys, _waves_time, splits
    # Powers of two of CTAs fill 97% of 132 SMs: the counts the measured grid ran stay
    for ctas in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096):
        for key_blocks in (64, 256, 1024, 4096, 8192):
            one_wave = 1 if ctas >= 0.8 * 132 else min(128, -(-key_blocks // 8), 132 // ctas)
            assert splits(ctas, key_blocks, 8, 132, sms=132) == splits(ctas, key_blocks, 8, 132, sms=1) != 0
            assert splits(ctas, key_blocks, 8, 132, sms=132) <= one_wave
    # One CTA per SM over 64k caches (4096 blocks of 16 keys, 8 warps): CTA counts that leave a
    # wave partly idle are split into whole waves where the model saves at least a tenth
    assert splits(ctas=104, key_blocks=4096, warps=8, slots=132, sms=132) == 5   # 520 CTAs: 3.94 waves, not 0.79
    assert splits(ctas=140, key_blocks=4096, warps=8, slots=132, sms=132) == 9   # 9.55 waves, not a second of 8 CTAs
    assert splits(ctas=72, key_blocks=4096, warps=8, slots=132, sms=132) == 9    # 4.91 waves, not 0.55
    assert splits(ctas=120, key_blocks=4096, warps=8, slots=132, sms=132) == 1   # 91% of the SMs: kept
    assert splits(ctas=140, key_blocks=4096, warps=8, slots=264, sms=132) == 1   # two a SM: the SMs stay busy
    assert splits(ctas=140, key_blocks=256, warps=8, slots=132, sms=132) == 1    # a 4k cache: short streams
    for ctas in range(1, 300):
        count = splits(ctas, 4096, 8, 132, sms=132)
        one_wave = _splits_with_keys(4096, 8, 1 if ctas >= 0.8 * 132 else min(128, 512, 132 // ctas))[0]
        if count != one_wave:
            assert _waves_time(ctas, 4096, 8, 132, count) <= 0.9 * _waves_time(ctas, 4096, 8, 132, one_wave)
            waves = ctas * one_wave / 132
            assert waves / -(-ctas * one_wave // 132) < 0.85


def test_tiny_short_calls_take_the_small_tile_where_it_runs_twice_the_warps(monkeypatch):
    from cupyflash import _config, _kvcache
    monkeypatch.delenv("CUPYFLASH_TILES", raising=False)
    h200 = _kvcache.DecodeDevice(132, lambda table, headdim: _config.tile_for(table, headdim, (9, 0), 227 * 1024),
                                 None)  # its tables and SMs (residency aside)
    short, long = (0, 1024), (0, 5000)  # (page rows, key rows a CTA streams)
    assert _kvcache._table(1, *short, 64, h200) == "decode_small"   # hd64 1 x 1k 8/1: 4 x 8 warps against 16 x 4
    assert _kvcache._table(16, *short, 64, h200) == "decode_small"  # 16 x 1k 8/1: 512 against 1024
    assert _kvcache._table(32, *short, 64, h200) == "decode_few"    # 1 x 1k 32/32: 1024 each
    assert _kvcache._table(128, *short, 64, h200) == "decode_few"   # one split either way
    assert _kvcache._table(1, *short, 128, h200) == "decode_few"    # hd128: 11 x 6 against 8 x 8
    assert _kvcache._table(1, *long, 64, h200) == "decode_few"      # long dense caches keep it
    assert _kvcache._table(133, *short, 64, h200) == "decode_small"


@pytest.mark.parametrize("cell, heads", [("1:131072:32:8:64:paged256", 4), ("1:16384:32:8:64:paged256", 1),
                                         ("4:1024:32:8:128:dense", 1)])
def test_the_plan_launches_the_layout_of_its_device(cell, heads, monkeypatch):
    """_new_plan without a GPU: the device's facts (SMs, tiles, resident CTAs: an H100's as
    bench/decode_plans.py models them) reach decode_layout, and its grid, kernel and split count
    reach the launches and the parameter block."""
    import types
    from cupyflash import _kvcache, _launch, _plan, _schedule
    from test_benchmark import _bench_script
    plans = _bench_script("decode_plans")
    h100 = plans.modelled_device("h100")
    expected = plans.layout_of(cell, h100)
    assert expected.heads == heads
    batch, capacity, nheads, nheads_k, headdim, page = plans.parse_decode_cell(cell)
    monkeypatch.setattr(_schedule, "device_attributes", lambda device_id: {"MultiProcessorCount": h100.sms})
    monkeypatch.setattr(_schedule, "tile", lambda table, hd, device_id: h100.tile(table, hd))
    monkeypatch.setattr(_schedule, "resident_ctas", lambda kernel, device: h100.resident(kernel))
    monkeypatch.setattr(_launch, "available", lambda compute_capability: False)  # no clusters
    monkeypatch.setattr(_schedule, "device_info", lambda device_id: (None, (9, 0), 227 * 1024))
    monkeypatch.setattr(_kvcache, "params_of", lambda call, cache, arrays, tile, count: {"num_splits": count})
    monkeypatch.setattr(_plan, "Plan", lambda caller, params, arrays, outputs, launches: (params, launches))
    shape = types.SimpleNamespace(batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=1, headdim=headdim)
    call = types.SimpleNamespace(shape=shape, dtype="bfloat16", local=True, features=(),
                                 caller=types.SimpleNamespace(device_id=0, device=lambda: None))
    cache = types.SimpleNamespace(capacity=capacity, page_size=page, num_splits=0, seqlen_new=1)
    q = types.SimpleNamespace(shape=(batch, 1, nheads, headdim))
    params, launches = _kvcache._new_plan(call, cache, {"q": q})
    assert params == {"num_splits": expected.splits, "merge_in_cluster": 0, "decode_heads_log2": heads.bit_length() - 1}
    append, decode, *combine = launches
    assert append.kernel.pass_ == "kvcache_append" and decode.kernel == expected.kernel
    assert decode.grid == (expected.m_blocks * expected.splits, nheads_k // heads, batch) and decode.cluster == 1
    assert [c.kernel.pass_ for c in combine] == (["decode_combine"] if expected.splits > 1 else [])


def test_the_plan_signature_tells_calls_apart():
    """A GPU call whose signature equals an earlier one's skips validation under no_host_sync, so the
    signature must differ wherever validation or the plan could: layouts, dtypes, which arguments
    are given, the scalars' values and types."""
    torch = pytest.importorskip("torch")
    from cupyflash._kvcache import signature

    def key(q=None, k_cache=None, k=None, causal=True, window=(-1, -1), lengths=5):
        q = torch.zeros(2, 1, 4, 32) if q is None else q
        k_cache = torch.zeros(2, 64, 2, 32) if k_cache is None else k_cache
        scalars = (None, causal, window, 0.0, True, 0, False, lengths)
        return signature((q, k_cache, k_cache, k, k) + (None,) * 7, scalars)
    base = key()
    assert base is not None and base == key()
    variants = [key(causal=1), key(lengths=6), key(lengths=None), key(window=(3, 0)),
                key(q=torch.zeros(2, 4, 1, 32).transpose(1, 2)), key(q=torch.zeros(2, 1, 4, 32, dtype=torch.float16)),
                key(k_cache=torch.zeros(2, 65, 2, 32)), key(k=torch.zeros(2, 1, 2, 32))]
    assert len({base, *variants}) == len(variants) + 1
    assert key(window=[-1, -1]) is None and key(q=np.zeros((2, 1, 4, 32))) is None


@pytest.mark.parametrize("paged", [False, True])
def test_the_decode_parameter_block_has_every_layout_and_option(paged):
    """The decode plan's parameter block (built on the CPU from NumPy arrays of the call's layouts):
    each tensor's (batch, row, head) strides, out contiguous, the cache's and rotary's fields, and the
    options' fields as every plan fills them."""
    from cupyflash import _config, _kvcache, validate
    case, rng = _case(batch=2, seqlen_q=2, capacity=64, rotary_dim=8)
    q = np.ascontiguousarray(case["q"].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # heads outermost
    table = None
    if paged:
        table = rng.permutation(9)[:8].reshape(2, 4).astype(np.int32)
        for name in ("k_cache", "v_cache"):
            case[name] = rng.standard_normal((9, 16, 2, 40))
    alibi = rng.uniform(0.1, 0.5, (2, 4)).astype(np.float32)
    call, cache = validate.check_kvcache(q, case["k_cache"], case["v_cache"], case["k"], case["v"], case["rotary_cos"],
                                         case["rotary_sin"], case["cache_seqlens"], None, None, table, None, True,
                                         dict(window_size=(9, -1), softcap=2.0, alibi_slopes=alibi), False, 0)
    arrays = dict(q=q, k=case["k_cache"], v=case["v_cache"], k_new=case["k"], v_new=case["v"],
                  rotary_cos=case["rotary_cos"], rotary_sin=case["rotary_sin"], cache_seqlens=case["cache_seqlens"],
                  alibi_slopes=alibi, **({} if table is None else dict(block_table=table)))
    params = _kvcache.params_of(call, cache, arrays, _config.Tile(64, 16, 16, 4, 2), 3)[0]
    for name, array in (("q", q), ("k", case["k_cache"]), ("v", case["v_cache"]), ("k_new", case["k"]),
                        ("v_new", case["v"]), ("out", case["q"])):  # out: contiguous in q's shape
        batch, row, head = (s // array.itemsize for s in array.strides[:3])
        assert (params[f"{name}_batch_stride"], params[f"{name}_row_stride"], params[f"{name}_head_stride"]) == \
            (batch, row, head), name
    assert (params["batch"], params["nheads"], params["nheads_k"], params["seqlen_q"], params["headdim"],
            params["headdim_padded"]) == (2, 4, 2, 2, 40, 64)
    assert (params["capacity"], params["seqlen_k"], params["seqlen_new"], params["num_splits"]) == (64, 64, 2, 3)
    assert params["cache_rows"] == (9 if paged else 2) and params["page_size"] == (16 if paged else 0)
    assert params["block_table_batch_stride"] == (4 if paged else 0)
    assert (params["rotary_rows"], params["rotary_dim"], params["rotary_cos_row_stride"], params["rotary_interleaved"],
            params["rotary_q_per_row"], params["rotary_is_float32"]) == (66, 8, 4, 0, 1, 0)
    assert (params["window_left"], params["window_right"]) == (9, 0)  # causal folded into the window
    assert params["softcap_inner"] == np.float32(40 ** -0.5 / 2.0) and params["alibi_batch_stride"] == 4


def test_the_caches_are_never_copied_but_misaligned_q_is():
    """The plan's inputs: a cache whose rows the kernels cannot read by 16-byte copies is refused
    (naming it: a copy would lose the in-place append); a misaligned q is copied."""
    torch = pytest.importorskip("torch")
    from cupyflash import _arrays, _kvcache
    caller = _arrays.Caller("torch", 0)
    cache = torch.zeros(2, 32, 2, 16, dtype=torch.bfloat16)
    q = torch.zeros(2 * 4 * 16 + 1, dtype=torch.bfloat16)[1:].view(2, 1, 4, 16)  # 2 bytes past an aligned start
    arrays = dict(q=q, k=cache, v=cache.clone(), cache_seqlens=torch.zeros(2, dtype=torch.int32))
    inputs, copied = _kvcache._launchable(caller, arrays)
    assert copied and inputs["q"] is not q and torch.equal(inputs["q"], q) and inputs["q"].data_ptr() % 16 == 0
    assert inputs["k"] is cache and inputs["cache_seqlens"] is arrays["cache_seqlens"]
    odd = torch.zeros(2, 33, 2, 20, dtype=torch.bfloat16)[:, :, :, :16]  # rows 40 bytes apart
    with pytest.raises(ValueError, match="k_cache must start on a 16-byte boundary"):
        _kvcache._launchable(caller, dict(arrays, k=odd))
    _, copied = _kvcache._launchable(caller, dict(arrays, q=torch.zeros(2, 1, 4, 16, dtype=torch.bfloat16)))
    assert not copied


def test_short_steps_take_fewer_splits_where_their_clusters_then_fit():
    from cupyflash._kvcache import fewer_splits_in_clusters
    # clusters of each size that one wave holds, for `ctas` query blocks (an H200-like GPU: 15 of 8, 30 of 4)
    def fit(ctas):
        return lambda splits: 1 < splits <= 8 and ctas <= {2: 60, 3: 40, 4: 30, 5: 22, 6: 20, 7: 15, 8: 15}[splits]
    assert fewer_splits_in_clusters(8, 64, 8, fit(16)) == 4     # 16 x 8 do not fit, 16 x 4 do (6 and 7 round to 4)
    assert fewer_splits_in_clusters(4, 64, 8, fit(32)) == 3     # 32 x 4 do not, 32 x 3 do
    assert fewer_splits_in_clusters(16, 64, 4, fit(8)) == 8     # past a cluster: 8 x 8 fit
    assert fewer_splits_in_clusters(8, 64, 8, fit(15)) == 8     # they fit already
    assert fewer_splits_in_clusters(4, 256, 8, fit(32)) == 4    # 8 steps a split: the combine stays
    assert fewer_splits_in_clusters(8, 256, 8, fit(16)) == 8    # 4 steps a split: so does it (v58: 6 ran 9% slower)
    assert fewer_splits_in_clusters(16, 64, 8, fit(16)) == 4    # 16 asked, 8 get keys: as the first case
    assert fewer_splits_in_clusters(32, 64, 2, fit(16)) == 32   # half would be 16: no cluster holds them
    for ctas in (1, 8, 16, 24, 32, 64):
        for count in range(1, 40):
            for key_blocks in (8, 64, 256):
                fewer = fewer_splits_in_clusters(count, key_blocks, 8, fit(ctas))
                per_split = -(-(-(-key_blocks // fewer)) // 8) * 8
                assert (fewer - 1) * per_split < key_blocks <= fewer * per_split  # every split gets keys
                asked = -(-key_blocks // (-(-(-(-key_blocks // count)) // 8) * 8))  # of `count`, those with keys
                assert fewer == asked or (2 * fewer >= asked and fit(ctas)(fewer) and not fit(ctas)(asked))
