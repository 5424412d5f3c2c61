"""flash_attn_with_kvcache's semantics in float64: the new keys and values appended into the
caches in place (rotated first), then attention of the (rotated) queries over each sequence's
cached keys.

Layout (flash_attn's):
    q            (batch, seqlen_q, nheads, headdim)
    k_cache      (batch_cache, capacity, nheads_k, headdim), or paged: (num_blocks, page_size,
                 nheads_k, headdim) with block_table (batch, pages per sequence), sequence b's
                 cache position t in block block_table[b, t // page_size], row t % page_size
    k, v         (batch, seqlen_new, nheads_k, headdim), written at positions
                 cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of sequence b's cache
    rotary       cos, sin (seqlen_ro, rotary_dim / 2): the first rotary_dim dims of each new key
                 turn by the angle of its position; q's rows by the angle of position
                 cache_seqlens[b] + i when causal or local, else all of them at cache_seqlens[b]
Sequence b reads cache row cache_batch_idx[b] (default b) and keys at positions
cache_leftpad[b] (default 0) up to cache_seqlens[b] + seqlen_new (exclusive); masks, ALiBi and
the causal alignment (bottom-right) see those keys as positions 0 .. seqlen_k - 1. Positions are
cache positions everywhere, the rotary angles included.

The caches hold the appended values in their own dtype (rounded once), and attention reads them
back from there, as the kernels do.
"""

import numpy as np

from .naive import attention_forward


def rotate(x, cos, sin, positions, interleaved):
    """x (seqlen, nheads, headdim) with its first 2 * cos.shape[1] dims rotated, row i by the angle of
    position positions[i], in float64: pairs (2j, 2j + 1) when interleaved (GPT-J), else
    (j, j + rotary_dim / 2) (GPT-NeoX); the other dims unchanged."""
    x = np.array(x, dtype=np.float64)
    half = np.shape(cos)[1]
    c = np.asarray(cos, np.float64)[positions][:, None, :]  # (seqlen, 1, half)
    s = np.asarray(sin, np.float64)[positions][:, None, :]
    if interleaved:
        first, second = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = first * c - second * s, first * s + second * c
    else:
        first, second = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half], x[..., half:2 * half] = first * c - second * s, first * s + second * c
    return x


def cache_positions(capacity, block_table, b, page_size):
    """(rows, blocks) of sequence b's cache positions 0 .. capacity - 1: for a dense cache the
    row index, for a paged one the page's row and its block."""
    t = np.arange(capacity)
    if block_table is None:
        return t, None
    return t % page_size, np.asarray(block_table)[b, t // page_size]


def kvcache_attention(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                      causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None):
    """(out, lse) in float64, after writing k and v into k_cache and v_cache in place (the
    arguments as cupyflash.validate.check_kvcache passed them: cache_seqlens, cache_batch_idx,
    cache_leftpad and block_table NumPy int arrays or None, cache_seqlens per batch entry)."""
    batch, seqlen_q, nheads, headdim = q.shape
    paged = block_table is not None
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    lengths = np.full(batch, capacity - seqlen_new) if cache_seqlens is None else np.asarray(cache_seqlens)
    local = causal or tuple(window_size) != (-1, -1)
    out = np.zeros((batch, seqlen_q, nheads, headdim))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        end = int(lengths[b]) + seqlen_new
        rows, blocks = cache_positions(capacity, block_table, b, page_size)

        def at(t):  # the cache index of sequence b's positions t (written in place through it)
            return (blocks[t], rows[t]) if paged else (row, rows[t])

        qb = np.asarray(q[b], np.float64)
        if k is not None:
            new = np.arange(int(lengths[b]), end)
            kb, vb = k[b], v[b]
            if rotary_cos is not None:
                kb = rotate(kb, rotary_cos, rotary_sin, new, rotary_interleaved)
                qpos = int(lengths[b]) + np.arange(seqlen_q) if local else np.full(seqlen_q, int(lengths[b]))
                qb = rotate(qb, rotary_cos, rotary_sin, qpos, rotary_interleaved)
            k_cache[at(new)] = np.asarray(kb, np.float64).astype(k_cache.dtype)
            v_cache[at(new)] = np.asarray(vb, np.float64).astype(v_cache.dtype)
        if end <= start:
            continue  # no key: out 0, lse -inf
        keys = np.arange(start, end)
        kb, vb = (np.asarray(cache[at(keys)], np.float64)[None] for cache in (k_cache, v_cache))
        slopes = None
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes, np.float64)
            slopes = slopes[b] if slopes.ndim == 2 else slopes
        o, l = attention_forward(qb[None], kb, vb, softmax_scale, causal, window_size=window_size, softcap=softcap,
                                 alibi_slopes=slopes)
        out[b], lse[b] = o[0], l[0]
    return out, lse
