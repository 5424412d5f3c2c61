"""What every reference function shares: the mask, the score transform, the softmax, the
heads-first layout and the options as the reference takes them."""

import math
from typing import NamedTuple

import numpy as np

from ..options import window_bounds

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)



# ---------------------------------------------------------------------------
# Shared building blocks: the mask, the score bias, the score transform.
# ---------------------------------------------------------------------------

def _diagonal_offset(seqlen_q, seqlen_k, rows, cols):
    """(m, n) matrix of j - (i + seqlen_k - seqlen_q): how far key j lies right of row i's diagonal."""
    row = np.arange(seqlen_q)[rows, None]
    col = np.arange(seqlen_k)[None, cols]
    # Bottom-right alignment: the last query row's diagonal is the last key.
    return col - (row + (seqlen_k - seqlen_q))


def visible(seqlen_q, seqlen_k, causal, rows=slice(None), cols=slice(None), *, window_size=(-1, -1)):
    """Bool matrix whose entry (i, j) says whether query row i may attend to key j.

    rows and cols are slices of the full ranges, so tiled code can ask for one tile.
    """
    left, right = window_bounds(causal, window_size)
    offset = _diagonal_offset(seqlen_q, seqlen_k, rows, cols)
    mask = np.ones(offset.shape, dtype=bool)
    if left >= 0:
        mask &= offset >= -left
    if right >= 0:
        mask &= offset <= right
    return mask


def _block_range(index, length, block, reach_before, reach_after):
    """Blocks of range(length) that hold any of index.start - reach_before .. index.stop - 1 + reach_after.

    index is a slice of the other axis; a reach of None is unbounded.
    """
    if block < 1:
        raise ValueError(f"block size must be positive, got {block}")
    first = 0 if reach_before is None else max(index.start - reach_before, 0)
    last = length - 1 if reach_after is None else min(index.stop - 1 + reach_after, length - 1)
    if index.start >= index.stop or first > last:
        return range(0)
    return range(first // block, last // block + 1)


def key_block_range(rows, seqlen_q, seqlen_k, block_n, causal=False, *, window_size=(-1, -1)):
    """Indices of the key blocks (of block_n keys) that query rows `rows` (a slice) see at all.

    Each row sees one contiguous run of keys and the runs of neighbouring rows overlap or touch, so this
    range is exact: every block in it has a visible key, every block outside is fully masked and
    the tiled code never visits it.
    """
    left, right = window_bounds(causal, window_size)
    start, stop, _ = rows.indices(seqlen_q)
    shift = seqlen_k - seqlen_q
    # Row i sees keys i + shift - left .. i + shift + right.
    return _block_range(slice(start, stop), seqlen_k, block_n,
                        None if left < 0 else left - shift, None if right < 0 else right + shift)


def query_block_range(cols, seqlen_q, seqlen_k, block_m, causal=False, *, window_size=(-1, -1)):
    """Indices of the query blocks (of block_m rows) that see any key of `cols` (a slice); exact."""
    left, right = window_bounds(causal, window_size)
    start, stop, _ = cols.indices(seqlen_k)
    shift = seqlen_k - seqlen_q
    # Key j is seen by rows j - shift - right .. j - shift + left.
    return _block_range(slice(start, stop), seqlen_q, block_m,
                        None if right < 0 else right + shift, None if left < 0 else left - shift)


def score_bias(seqlen_q, seqlen_k, alibi_slopes=None, attn_bias=None, rows=slice(None), cols=slice(None)):
    """ALiBi plus attn_bias for one tile, broadcastable to (batch, nheads, m, n); None if neither.

    alibi_slopes must already be shaped (batch or 1, nheads, 1, 1) and attn_bias broadcast to
    (batch, nheads, seqlen_q, seqlen_k) (see _check_options).
    """
    bias = None
    if alibi_slopes is not None:
        distance = np.abs(_diagonal_offset(seqlen_q, seqlen_k, rows, cols))
        bias = -alibi_slopes * distance
    if attn_bias is not None:
        tile = attn_bias[:, :, rows, cols]
        bias = tile if bias is None else bias + tile
    return bias


def scaled_scores(q, k, scale, mask, round_fn=None, *, softcap=0.0, bias=None, log2=False,
                  return_tanh=False):
    """Softmax logits of q against k. The one score transform, in this order:

        s = (q k^T) * scale
        s = softcap * tanh(s / softcap)       if softcap > 0
        s = s + bias                          ALiBi and attn_bias together (score_bias)
        s = -inf where mask is False
    lse is the log-sum-exp of this final s.

    q is (batch, nheads, m, headdim) and k (batch, nheads, n, headdim), heads first; mask is
    (m, n) and bias broadcasts to (batch, nheads, m, n). Computes in q's dtype. round_fn, if
    given, rounds the result of each operation (low-precision emulation). log2=True returns
    s * log2(e) for an exp2 softmax, with log2(e) folded into the last multiplications as the
    kernels do. return_tanh=True returns (s, t) with t = tanh(s / softcap), None without softcap:
    the backward needs d softcap(x) / dx = 1 - t^2.
    """
    keep = round_fn or (lambda x: x)
    unit = LOG2E if log2 else 1.0
    s = keep(q @ k.swapaxes(-1, -2))
    t = None
    if softcap:
        s = keep(s * np.asarray(scale, dtype=s.dtype))
        t = keep(np.tanh(keep(s / np.asarray(softcap, dtype=s.dtype))))
        s = keep(t * np.asarray(softcap * unit, dtype=s.dtype))
    else:
        s = keep(s * np.asarray(scale * unit, dtype=s.dtype))
    if bias is not None:
        s = keep(s + keep(bias).astype(s.dtype) * np.asarray(unit, dtype=s.dtype))
    s = np.where(mask, s, -np.inf)
    return (s, t) if return_tanh else s


def _softmax(s):
    """Row softmax of logits s; returns (p, lse). Rows of all -inf give p = 0, lse = -inf."""
    row_max = s.max(axis=-1, keepdims=True, initial=-np.inf)
    # An empty row has max -inf; shifting it by 0 instead makes exp give 0, not NaN.
    row_max = np.where(np.isneginf(row_max), 0, row_max)
    p = np.exp(s - row_max)
    row_sum = p.sum(axis=-1, keepdims=True)
    p /= np.where(row_sum > 0, row_sum, 1)  # (in place: these are the tests' largest arrays)
    with np.errstate(divide="ignore"):
        lse = (row_max + np.log(row_sum))[..., 0]
    return p, lse


def _sum_to_shape(x, shape):
    """Sum x over the axes along which an array of `shape` was broadcast to x's shape."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    axes = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)



# ---------------------------------------------------------------------------
# Layout helpers and option checks. Internally everything is heads first:
# (batch, nheads, seqlen, headdim), with kv heads repeated so that every query head has its own copy.
# ---------------------------------------------------------------------------

def _check_shapes(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-d: (batch, seqlen, nheads, headdim)")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"nheads ({q.shape[2]}) must be a multiple of nheads_k ({k.shape[2]})")


class _Options(NamedTuple):
    """The validated masking and score options of one call."""
    window_size: tuple  # (left, right), causal folded in
    softcap: float
    alibi_slopes: object  # None or (batch or 1, nheads, 1, 1) float64
    attn_bias: object  # None or a read-only float64 view broadcast to (batch, nheads, seqlen_q, seqlen_k)
    bias_shape: object  # attn_bias's own shape (dbias gets it), or None


def _check_options(q_shape, seqlen_k, causal, window_size, softcap, alibi_slopes, attn_bias):
    batch, seqlen_q, nheads, _ = q_shape
    window = window_bounds(causal, window_size)
    try:
        softcap = float(softcap)
    except (TypeError, ValueError):
        raise TypeError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap!r}") from None
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap!r}")
    if alibi_slopes is not None:
        alibi_slopes = np.asarray(alibi_slopes, dtype=np.float64)
        if alibi_slopes.shape not in ((nheads,), (batch, nheads)):
            raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), "
                             f"got {alibi_slopes.shape}")
        alibi_slopes = alibi_slopes.reshape(-1, nheads, 1, 1)
    bias_shape = None
    if attn_bias is not None:
        attn_bias = np.asarray(attn_bias, dtype=np.float64)
        bias_shape = attn_bias.shape
        full = (batch, nheads, seqlen_q, seqlen_k)
        try:
            attn_bias = np.broadcast_to(attn_bias, full)
        except ValueError:
            raise ValueError(f"attn_bias must broadcast to (batch, nheads, seqlen_q, seqlen_k) = {full}, "
                             f"got shape {bias_shape}") from None
    return _Options(window, softcap, alibi_slopes, attn_bias, bias_shape)


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


def _setup(q, k, v, softmax_scale, round_fn=None, causal=False, window_size=(-1, -1), softcap=0.0,
           alibi_slopes=None, attn_bias=None):
    """Validate, go heads first, expand kv heads, resolve the default scale and the options."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _check_shapes(q, k, v)
    opts = _check_options(q.shape, k.shape[1], causal, window_size, softcap, alibi_slopes, attn_bias)
    nheads = q.shape[2]
    qh = _heads_first(q, round_fn)
    kh = _expand_kv(_heads_first(k, round_fn), nheads)
    vh = _expand_kv(_heads_first(v, round_fn), nheads)
    if softmax_scale is None:
        softmax_scale = q.shape[3] ** -0.5
    return qh, kh, vh, float(softmax_scale), opts


def _scores(qh, kh, scale, opts, rows=slice(None), cols=slice(None), round_fn=None, log2=False):
    """Logits and tanh values (see scaled_scores) of query rows `rows` against keys `cols`."""
    seqlen_q, seqlen_k = qh.shape[2], kh.shape[2]
    mask = visible(seqlen_q, seqlen_k, False, rows, cols, window_size=opts.window_size)
    bias = score_bias(seqlen_q, seqlen_k, opts.alibi_slopes, opts.attn_bias, rows, cols)
    return scaled_scores(qh[:, :, rows], kh[:, :, cols], scale, mask, round_fn, softcap=opts.softcap,
                         bias=bias, log2=log2, return_tanh=True)


def _grads_to_layout(dq, dk, dv, nheads_k):
    return _seq_first(dq), _seq_first(_sum_kv_groups(dk, nheads_k)), _seq_first(_sum_kv_groups(dv, nheads_k))


def _with_dbias(grads, dbias, opts, return_dbias, round_fn=None):
    """(dq, dk, dv), plus dbias in attn_bias's shape (None without attn_bias) when asked for."""
    if not return_dbias:
        return grads
    if opts.bias_shape is None:
        return grads + (None,)
    dbias = _sum_to_shape(dbias, opts.bias_shape)
    return grads + (round_fn(dbias) if round_fn else dbias,)
