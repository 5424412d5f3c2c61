"""NumPy reference implementations of attention, used to check the CUDA kernels.

Layout (flash_attn's):
    q         (batch, seqlen_q, nheads, headdim)
    k, v      (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0
    out       like q
    lse       (batch, nheads, seqlen_q), natural log of the softmax denominator
Query head h reads kv head h // (nheads // nheads_k) (GQA / MQA).
The default softmax_scale is headdim ** -0.5.

Causal masking is aligned to the bottom-right corner (flash_attn >= 2.1):
query row i sees key j iff j <= i + seqlen_k - seqlen_q.

Empty rows: a query row that sees no key (causal with seqlen_q > seqlen_k) has
out = 0 and lse = -inf (the log of an empty sum), and contributes zero gradient
to q, k and v. No function here returns NaN for such a row.

Three families of functions share one mask (`visible`) and one score transform
(`scaled_scores`), so future options (window, softcap, ALiBi, ...) go in one place:
  * attention_forward / attention_backward: naive float64, full score matrix.
  * attention_forward_tiled / attention_backward_tiled: the FlashAttention-2
    algorithm written out tile by tile, also in float64.
  * attention_forward_lowp / attention_backward_lowp: float16 / bfloat16 emulation,
    the tolerance yardstick for GPU tests.
"""

import math

import numpy as np

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# ---------------------------------------------------------------------------
# Shared building blocks: the mask and the score transform.
# ---------------------------------------------------------------------------

def visible(seqlen_q, seqlen_k, causal, rows=slice(None), cols=slice(None)):
    """Bool matrix whose entry (i, j) says whether query row i may attend to key j.

    rows and cols are slices of the full ranges, so tiled code can ask for one tile.
    """
    row = np.arange(seqlen_q)[rows, None]
    col = np.arange(seqlen_k)[None, cols]
    if not causal:
        return np.ones((row.shape[0], col.shape[1]), dtype=bool)
    # Bottom-right alignment: the last query row sees every key.
    return col <= row + (seqlen_k - seqlen_q)


def scaled_scores(q, k, scale, mask, round_fn=None):
    """Softmax logits (q k^T) * scale, with entries hidden by mask set to -inf.

    q is (batch, nheads, m, headdim) and k (batch, nheads, n, headdim), heads first;
    mask is (m, n). Computes in q's dtype. round_fn, if given, rounds the result of
    each operation (low-precision emulation).
    """
    keep = round_fn or (lambda x: x)
    s = keep(q @ k.swapaxes(-1, -2))
    s = keep(s * np.asarray(scale, dtype=s.dtype))
    return np.where(mask, s, -np.inf)


def _softmax(s):
    """Row softmax of logits s; returns (p, lse). Rows of all -inf give p = 0, lse = -inf."""
    row_max = s.max(axis=-1, keepdims=True, initial=-np.inf)
    # An empty row has max -inf; shifting it by 0 instead makes exp give 0, not NaN.
    row_max = np.where(np.isneginf(row_max), 0, row_max)
    e = np.exp(s - row_max)
    row_sum = e.sum(axis=-1, keepdims=True)
    p = e / np.where(row_sum > 0, row_sum, 1)
    with np.errstate(divide="ignore"):
        lse = (row_max + np.log(row_sum))[..., 0]
    return p, lse


# ---------------------------------------------------------------------------
# Layout helpers. Internally everything is heads first: (batch, nheads, seqlen, headdim),
# with kv heads repeated so that every query head has its own copy.
# ---------------------------------------------------------------------------

def _check_shapes(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-d: (batch, seqlen, nheads, headdim)")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"nheads ({q.shape[2]}) must be a multiple of nheads_k ({k.shape[2]})")


def _heads_first(x, round_fn=None):
    """(batch, seqlen, heads, dim) -> contiguous (batch, heads, seqlen, dim).

    float64 by default; with round_fn, the float32 values it returns.
    """
    x = np.asarray(x)
    x = round_fn(x) if round_fn else x.astype(np.float64)
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _seq_first(x):
    """Inverse of _heads_first's transpose: back to flash_attn's layout."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _expand_kv(x, nheads):
    """Repeat each kv head for the query heads of its group (heads-first layout)."""
    return np.repeat(x, nheads // x.shape[1], axis=1)


def _sum_kv_groups(dx, nheads_k):
    """Sum a per-query-head gradient back onto the kv head each group shares."""
    batch, nheads, seqlen, dim = dx.shape
    return dx.reshape(batch, nheads_k, nheads // nheads_k, seqlen, dim).sum(axis=2)


def _setup(q, k, v, softmax_scale, round_fn=None):
    """Validate, go heads first, expand kv heads, resolve the default scale."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _check_shapes(q, k, v)
    nheads = q.shape[2]
    qh = _heads_first(q, round_fn)
    kh = _expand_kv(_heads_first(k, round_fn), nheads)
    vh = _expand_kv(_heads_first(v, round_fn), nheads)
    if softmax_scale is None:
        softmax_scale = q.shape[3] ** -0.5
    return qh, kh, vh, float(softmax_scale)


def _grads_to_layout(dq, dk, dv, nheads_k):
    return _seq_first(dq), _seq_first(_sum_kv_groups(dk, nheads_k)), _seq_first(_sum_kv_groups(dv, nheads_k))


# ---------------------------------------------------------------------------
# Naive float64 attention.
# ---------------------------------------------------------------------------

def attention_forward(q, k, v, softmax_scale=None, causal=False):
    """Naive attention in float64. Returns (out, lse)."""
    qh, kh, vh, scale = _setup(q, k, v, softmax_scale)
    mask = visible(qh.shape[2], kh.shape[2], causal)
    p, lse = _softmax(scaled_scores(qh, kh, scale, mask))
    return _seq_first(p @ vh), lse


def attention_backward(dout, q, k, v, softmax_scale=None, causal=False):
    """Analytic gradient of attention_forward in float64. Returns (dq, dk, dv).

    dk and dv are summed over the query heads that share each kv head.
    """
    nheads_k = np.shape(k)[2]
    qh, kh, vh, scale = _setup(q, k, v, softmax_scale)
    doh = _heads_first(dout)
    mask = visible(qh.shape[2], kh.shape[2], causal)
    p, _ = _softmax(scaled_scores(qh, kh, scale, mask))

    dv = p.swapaxes(-1, -2) @ doh
    dp = doh @ vh.swapaxes(-1, -2)
    # Softmax backward: dS = P * (dP - rowsum(dP * P)).
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = ds @ kh * scale
    dk = ds.swapaxes(-1, -2) @ qh * scale
    return _grads_to_layout(dq, dk, dv, nheads_k)


# ---------------------------------------------------------------------------
# FlashAttention-2, tile by tile (float64 teaching version of the kernels).
# ---------------------------------------------------------------------------

def _blocks(length, block):
    """Slices that cut range(length) into blocks of `block` (the last may be shorter)."""
    if block < 1:
        raise ValueError(f"block size must be positive, got {block}")
    return [slice(start, min(start + block, length)) for start in range(0, length, block)]


def attention_forward_tiled(q, k, v, softmax_scale=None, causal=False, block_m=64, block_n=64):
    """FlashAttention forward: online softmax over key tiles. Returns (out, lse)."""
    qh, kh, vh, scale = _setup(q, k, v, softmax_scale)
    batch, nheads, seqlen_q, _ = qh.shape
    seqlen_k, headdim_v = kh.shape[2], vh.shape[3]
    # The kernel works in base 2: exp2 is a single instruction, and log2(e) folds into the scale.
    scale_log2 = scale * LOG2E
    out = np.empty((batch, nheads, seqlen_q, headdim_v))
    lse = np.empty((batch, nheads, seqlen_q))

    for rows in _blocks(seqlen_q, block_m):  # one thread block per query tile
        q_tile = qh[:, :, rows]
        n_rows = rows.stop - rows.start
        row_max = np.full((batch, nheads, n_rows), -np.inf)  # max of S * scale_log2 so far
        row_sum = np.zeros((batch, nheads, n_rows))  # sum of exp2(S * scale_log2 - row_max)
        acc = np.zeros((batch, nheads, n_rows, headdim_v))  # unnormalised output

        for cols in _blocks(seqlen_k, block_n):
            mask = visible(seqlen_q, seqlen_k, causal, rows, cols)
            if not mask.any():
                continue  # fully masked tile: the kernel never loads it
            s = scaled_scores(q_tile, kh[:, :, cols], scale_log2, mask)
            new_max = np.maximum(row_max, s.max(axis=-1))
            # A row with no visible key so far keeps max -inf; use 0 so exp2 gives 0, not NaN.
            safe_max = np.where(np.isneginf(new_max), 0.0, new_max)
            # Everything summed so far was relative to the old max: rescale it to the new one.
            correction = np.exp2(row_max - safe_max)
            p = np.exp2(s - safe_max[..., None])
            row_sum = row_sum * correction + p.sum(axis=-1)
            acc = acc * correction[..., None] + p @ vh[:, :, cols]
            row_max = new_max

        # Normalise once at the end instead of on every tile.
        has_keys = row_sum > 0
        out[:, :, rows] = acc / np.where(has_keys, row_sum, 1.0)[..., None]
        with np.errstate(divide="ignore"):
            # row_max is max(S) * scale * log2(e), so row_max * ln(2) = max(S) * scale.
            lse[:, :, rows] = np.where(has_keys, row_max * LN2 + np.log(row_sum), -np.inf)

    return _seq_first(out), lse


def attention_backward_tiled(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                             block_m=64, block_n=64):
    """FlashAttention-2 backward: key tiles outside, query tiles inside. Returns (dq, dk, dv).

    P is recomputed from the saved lse instead of being stored.
    """
    nheads_k = np.shape(k)[2]
    qh, kh, vh, scale = _setup(q, k, v, softmax_scale)
    doh = _heads_first(dout)
    seqlen_q, seqlen_k = qh.shape[2], kh.shape[2]
    lse = np.asarray(lse, dtype=np.float64)
    # Empty rows have lse = -inf; +inf instead makes exp(S - lse) = 0 there, not NaN.
    lse_for_p = np.where(np.isneginf(lse), np.inf, lse)
    # D_i = rowsum(dO * O) = rowsum(dP * P): computed once up front, so the loop never needs
    # a whole row of P.
    delta = (doh * _heads_first(out)).sum(axis=-1)

    dq = np.zeros_like(qh)
    dk = np.zeros_like(kh)
    dv = np.zeros_like(vh)
    for cols in _blocks(seqlen_k, block_n):  # one thread block per key tile
        k_tile, v_tile = kh[:, :, cols], vh[:, :, cols]
        # dk, dv of this key tile stay in registers for the whole inner loop.
        dk_acc = np.zeros_like(k_tile)
        dv_acc = np.zeros_like(v_tile)

        for rows in _blocks(seqlen_q, block_m):
            mask = visible(seqlen_q, seqlen_k, causal, rows, cols)
            if not mask.any():
                continue
            q_tile, do_tile = qh[:, :, rows], doh[:, :, rows]
            s = scaled_scores(q_tile, k_tile, scale, mask)
            p = np.exp(s - lse_for_p[:, :, rows, None])
            dv_acc += p.swapaxes(-1, -2) @ do_tile
            dp = do_tile @ v_tile.swapaxes(-1, -2)
            ds = p * (dp - delta[:, :, rows, None])
            dk_acc += ds.swapaxes(-1, -2) @ q_tile * scale
            # Several key tiles write the same dq rows: the kernel adds atomically in float32.
            dq[:, :, rows] += ds @ k_tile * scale

        dk[:, :, cols] = dk_acc
        dv[:, :, cols] = dv_acc

    return _grads_to_layout(dq, dk, dv, nheads_k)


# ---------------------------------------------------------------------------
# Low-precision emulation: the yardstick for GPU test tolerances.
# ---------------------------------------------------------------------------

# significand bits (with the implicit one), smallest normal exponent, largest finite value
_FORMATS = {
    "float16": (11, -14, 65504.0),
    "bfloat16": (8, -126, (2 - 2**-7) * 2.0**127),
}


def _format_name(dtype):
    """'float16' or 'bfloat16' from a string, numpy dtype or scalar type (ml_dtypes included)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _FORMATS:
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype!r}")
    return name


def round_to(x, dtype):
    """Round x to the nearest value representable in dtype (ties to even); returns float32.

    Rounds straight from x's own precision. (ml_dtypes casts float64 -> bfloat16 through
    float32, which rounds twice and is occasionally one ulp off.)
    """
    digits, min_exp, max_finite = _FORMATS[_format_name(dtype)]
    x = np.asarray(x, dtype=np.float64)
    _, exp = np.frexp(x)  # |x| = m * 2**exp with 0.5 <= m < 1
    # Exponent of the spacing between representable values near x; below the smallest
    # normal the spacing stays fixed (subnormals).
    step_exp = np.maximum(exp - 1, min_exp) - (digits - 1)
    rounded = np.ldexp(np.round(np.ldexp(x, -step_exp)), step_exp)  # np.round: ties to even
    rounded = np.where(np.abs(rounded) > max_finite, np.copysign(np.inf, rounded), rounded)
    with np.errstate(over="ignore"):
        return rounded.astype(np.float32)


def _lowp_scores_and_probs(q, k, v, dtype, softmax_scale, causal):
    """Shared start of the low-precision forward and backward."""
    round_fn = lambda x: round_to(x, dtype)  # noqa: E731
    qh, kh, vh, scale = _setup(q, k, v, softmax_scale, round_fn)
    mask = visible(qh.shape[2], kh.shape[2], causal)
    s = scaled_scores(qh, kh, scale, mask, round_fn)
    # Frameworks upcast softmax to float32 and store its result in the tensor's dtype.
    p, lse = _softmax(s)
    return qh, kh, vh, scale, round_to(p, dtype), lse, round_fn


def attention_forward_lowp(q, k, v, dtype, softmax_scale=None, causal=False, return_lse=False):
    """Attention as a framework computes it on float16 / bfloat16 tensors.

    Inputs are rounded to dtype; every matrix product runs in float32 and its result is
    rounded to dtype; softmax runs in float32. Returns out as float32 values representable
    in dtype (and, with return_lse, the log-sum-exp of the rounded scores). Empty rows give 0
    (a framework would give NaN).
    """
    _, _, vh, _, p, lse, round_fn = _lowp_scores_and_probs(q, k, v, dtype, softmax_scale, causal)
    out = _seq_first(round_fn(p @ vh))
    return (out, lse) if return_lse else out


def attention_backward_lowp(dout, q, k, v, dtype, softmax_scale=None, causal=False):
    """Gradient of attention_forward_lowp, as autograd computes it in dtype. Returns (dq, dk, dv).

    Each product is float32 then rounded; the softmax backward is float32 then rounded.
    """
    nheads_k = np.shape(k)[2]
    qh, kh, vh, scale, p, _, round_fn = _lowp_scores_and_probs(q, k, v, dtype, softmax_scale, causal)
    doh = _heads_first(dout, round_fn)

    dv = round_fn(p.swapaxes(-1, -2) @ doh)
    dp = round_fn(doh @ vh.swapaxes(-1, -2))
    ds = round_fn(p * (dp - (dp * p).sum(axis=-1, keepdims=True)))
    # The forward scaled S = q k^T after the product, so autograd scales dS before the products.
    ds = round_fn(ds * np.float32(scale))
    dq = round_fn(ds @ kh)
    dk = round_fn(ds.swapaxes(-1, -2) @ qh)
    # Gradients of repeated kv heads are summed in float32, then stored in dtype.
    dq, dk, dv = _grads_to_layout(dq, dk, dv, nheads_k)
    return dq, round_fn(dk), round_fn(dv)
