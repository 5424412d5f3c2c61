"""Helpers shared by the test_reference*.py files (CPU tests of the cupyflash/reference package): random inputs,
relative errors, finite differences, the compact option specs and every reference call; and the paged varlen
case of the KV cache's tests."""

import numpy as np

from cupyflash import reference as ref


def random_inputs(seed, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim):
    """q, k, v and dout in flash_attn's layout, float64 standard normal."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim))
    k = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    v = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    dout = rng.standard_normal((batch, seqlen_q, nheads, headdim))
    return q, k, v, dout


def rel_error(actual, expected):
    """Largest absolute error relative to the largest magnitude of expected."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    scale = np.abs(expected).max()
    return np.abs(actual - expected).max() / (scale if scale > 0 else 1.0)


def assert_lse_close(actual, expected, rtol):
    """Same -inf rows, finite rows close."""
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    assert np.isfinite(actual[finite]).all()
    assert rel_error(actual[finite], expected[finite]) < rtol


def numerical_gradient(loss, x, eps=1e-5):
    """Central finite differences of the scalar loss() with respect to every entry of x."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        saved = x[index]
        x[index] = saved + eps
        plus = loss()
        x[index] = saved - eps
        minus = loss()
        x[index] = saved
        grad[index] = (plus - minus) / (2 * eps)
    return grad


def representable(x, dtype):
    return np.array_equal(ref.round_to(x, dtype), x)


def make_options(seed, spec, batch, nheads, seqlen_q, seqlen_k):
    """Keyword arguments for the attention functions from a compact spec.

    spec keys: causal, window_size, softcap as is; alibi "h" for slopes (nheads,) or "bh" for
    (batch, nheads); bias a shape whose letters b, h, q, k stand for batch, nheads, seqlen_q,
    seqlen_k (1 broadcasts). Slopes and bias are fresh random values, never zeros.
    """
    rng = np.random.default_rng(seed)
    sizes = {"b": batch, "h": nheads, "q": seqlen_q, "k": seqlen_k, 1: 1}
    kwargs = {key: spec[key] for key in ("causal", "window_size", "softcap") if key in spec}
    if "alibi" in spec:
        kwargs["alibi_slopes"] = rng.uniform(0.05, 0.6, tuple(sizes[c] for c in spec["alibi"]))
    if "bias" in spec:
        kwargs["attn_bias"] = rng.standard_normal(tuple(sizes[c] for c in spec["bias"]))
    return kwargs


def reference_calls(q, k, v, dout, options):
    """Every dense reference function called with `options`, each as a thunk (for the argument checks)."""
    out, lse = ref.attention_forward(q, k, v)
    return [
        lambda: ref.attention_forward(q, k, v, **options),
        lambda: ref.attention_backward(dout, q, k, v, **options),
        lambda: ref.attention_forward_tiled(q, k, v, **options),
        lambda: ref.attention_backward_tiled(dout, q, k, v, out, lse, **options),
        lambda: ref.attention_forward_lowp(q, k, v, "float16", **options),
        lambda: ref.attention_backward_lowp(dout, q, k, v, "bfloat16", **options),
    ]


def paged_varlen_case(rng, page=16):
    """A varlen prefill over a paged cache (float64): q, packed k and v, cu_seqlens_q and _k (3 sequences of
    20, 7 and 33 keys; queries 3, 0 and 5), a block table of shuffled pages and the caches holding the keys."""
    cu_q, cu_k = np.array([0, 3, 3, 8], np.int32), np.array([0, 20, 27, 60], np.int32)
    q = rng.standard_normal((8, 4, 16))
    k, v = rng.standard_normal((60, 2, 16)), rng.standard_normal((60, 2, 16))
    pages, blocks = -(-33 // page), 3 * -(-33 // page) + 3
    table = rng.permutation(blocks)[:3 * pages].reshape(3, pages).astype(np.int32)
    caches = [rng.standard_normal((blocks, page, 2, 16)) for _ in range(2)]
    for b in range(3):
        t = np.arange(cu_k[b + 1] - cu_k[b])
        for cache, packed in zip(caches, (k, v)):
            cache[table[b, t // page], t % page] = packed[cu_k[b] + t]
    return q, k, v, cu_q, cu_k, table, caches


def paged_varlen_refusals(table, k_cache, v_cache):
    """Bad input to a varlen call over a paged cache (paged_varlen_case's table and caches, page 16),
    as (changed arguments, NumPy arrays; the exception; its message): the same for every kind of
    array, each test converting the arrays to its own."""
    out_of_cache = table.copy()
    out_of_cache[2, 1] = 99
    return [
        (dict(block_table=out_of_cache), ValueError, r"block_table\[2, 1\] = 99 is not a block"),
        (dict(block_table=np.ascontiguousarray(table[:, :2])), ValueError, "sequence 2 has 33 keys .* 2 pages of 16"),
        (dict(block_table=table.astype(np.float32)), TypeError, "block_table must be an int32 array"),
        (dict(block_table=table[:2]), ValueError, r"block_table must have shape \(batch, pages per sequence\)"),
        (dict(k=k_cache.reshape(-1, 8, 2, 16), v=v_cache.reshape(-1, 8, 2, 16)), ValueError,
         "page size .* multiple of 16"),
        (dict(v=v_cache[:-1]), ValueError, "k and v .* same shape"),
        (dict(cu_seqlens_k=np.array([0, 20, 7, 60], np.int32)), ValueError, "cu_seqlens_k must be non-decreasing"),
    ]
