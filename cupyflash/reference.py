"""NumPy reference implementations of attention, used to check the CUDA kernels.

Layout (flash_attn's):
    q         (batch, seqlen_q, nheads, headdim)
    k, v      (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0
    out       like q
    lse       (batch, nheads, seqlen_q), natural log of the softmax denominator
Query head h reads kv head h // (nheads // nheads_k) (GQA / MQA).
The default softmax_scale is headdim ** -0.5.

Options (flash_attn's names and meaning; every default means "off"):
    causal        query row i sees key j only if j <= i + seqlen_k - seqlen_q
    window_size   (left, right): row i sees key j only if
                  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right;
                  -1 leaves that side unbounded. With causal the two masks intersect,
                  which is the same as right = 0.
    softcap       > 0 squashes the scores into (-softcap, softcap) with tanh
    alibi_slopes  (nheads,) or (batch, nheads): head h adds -slope[h] * |i + seqlen_k - seqlen_q - j|
    attn_bias     additive bias broadcastable from (batch or 1, nheads or 1, seqlen_q, seqlen_k)
    dropout_p     > 0 drops probabilities after the softmax and rescales the kept ones by
                  1 / (1 - dropout_p); the mask comes from a counter-based Philox RNG keyed by
    seed          (see dropout_keep_mask), so the CUDA kernels can reproduce it bit for bit
All masking is aligned to the bottom-right corner (flash_attn >= 2.1).

Empty rows: a query row that sees no key (causal with seqlen_q > seqlen_k, or a window that
misses every key) has out = 0 and lse = -inf (the log of an empty sum), and contributes zero
gradient to q, k and v. No function here returns NaN for such a row.

Three families of functions share one mask (`visible`), one score transform (`scaled_scores`,
whose docstring gives the order of the options) and one block-skipping rule
(`key_block_range` / `query_block_range`), so every variant agrees:
  * attention_forward / attention_backward: naive float64, full score matrix.
  * attention_forward_tiled / attention_backward_tiled: the FlashAttention-2
    algorithm written out tile by tile, also in float64.
  * attention_forward_lowp / attention_backward_lowp: float16 / bfloat16 emulation,
    the tolerance yardstick for GPU tests.
Variable-length (packed) batches, flash_attn's varlen layout, run every sequence as its own
batch-1 problem through the naive or low-precision functions: attention_*_varlen(_lowp).
"""

import math
import numbers
import operator
from typing import NamedTuple

import numpy as np

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# Called as tile_hook(pass_name, rows, cols) for every tile the tiled functions compute
# ("forward" or "backward"; rows and cols are slices). Tests use it to see which tiles are skipped.
tile_hook = None


# ---------------------------------------------------------------------------
# Shared building blocks: the mask, the score bias, the score transform.
# ---------------------------------------------------------------------------

def window_bounds(causal, window_size=(-1, -1)):
    """(left, right) of the attention window, causal folded in as right = 0; -1 is unbounded."""
    try:
        left, right = (operator.index(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of integers >= -1, "
                         f"got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 means unbounded), got {window_size!r}")
    # Causal hides every key right of the diagonal: the intersection is the window with right = 0.
    return left, (0 if causal else right)


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
    e = np.exp(s - row_max)
    row_sum = e.sum(axis=-1, keepdims=True)
    p = e / np.where(row_sum > 0, row_sum, 1)
    with np.errstate(divide="ignore"):
        lse = (row_max + np.log(row_sum))[..., 0]
    return p, lse


def _sum_to_shape(x, shape):
    """Sum x over the axes along which an array of `shape` was broadcast to x's shape."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    axes = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


# ---------------------------------------------------------------------------
# Dropout: a Philox4x32-10 counter-based RNG, so that the mask of any score element can be
# recomputed anywhere (forward, backward, a tile, the GPU) from its coordinates and the seed.
# ---------------------------------------------------------------------------

_WORD = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)
_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))  # round multipliers
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))  # key bumps (Weyl sequence)
_PHILOX_ROUNDS = 10


def _philox_words(x, name):
    """x as uint64 holding 32-bit words; raises unless every entry is an integer in [0, 2**32)."""
    x = np.asarray(x)
    if x.dtype == bool or not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"Philox {name} words must be integers, got dtype {x.dtype}")
    if x.size and (x.min() < 0 or x.max() > 0xFFFFFFFF):
        raise ValueError(f"Philox {name} words must lie in [0, 2**32), got values in "
                         f"[{x.min()}, {x.max()}]")
    # uint64 holds a full 32 x 32-bit product; every constant above is uint64 too, so NumPy
    # never promotes to float64 (which it does for uint64 mixed with signed integers).
    return x.astype(np.uint64)


def philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al. 2011, as in Random123 and cuRAND), vectorised.

    counter is 4 and key 2 array-likes of 32-bit words, broadcast together. Returns a uint32
    array of shape (4,) + the broadcast shape: the 4 output words.
    """
    if len(counter) != 4 or len(key) != 2:
        raise ValueError(f"Philox4x32 takes 4 counter words and 2 key words, "
                         f"got {len(counter)} and {len(key)}")
    c0, c1, c2, c3 = (_philox_words(x, "counter") for x in counter)
    k0, k1 = (_philox_words(x, "key") for x in key)
    for round_index in range(_PHILOX_ROUNDS):
        if round_index:  # the key is bumped between rounds, not before the first
            k0 = (k0 + _PHILOX_W[0]) & _WORD
            k1 = (k1 + _PHILOX_W[1]) & _WORD
        product0 = _PHILOX_M[0] * c0
        product1 = _PHILOX_M[1] * c2
        c0, c1, c2, c3 = ((product1 >> _SHIFT) ^ c1 ^ k0, product1 & _WORD,
                          (product0 >> _SHIFT) ^ c3 ^ k1, product0 & _WORD)
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3)).astype(np.uint32)


def check_dropout_p(dropout_p):
    """dropout_p as a float in [0, 1); ValueError otherwise (a bool is not a probability)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise ValueError(f"dropout_p must be a real number in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not 0 <= p < 1:  # NaN fails too
        raise ValueError(f"dropout_p must be a real number in [0, 1), got {dropout_p!r}")
    return p


def check_seed(seed, dropout_p):
    """seed as a Python int in [0, 2**64); ValueError otherwise."""
    if seed is None:
        raise ValueError(f"seed is required when dropout_p > 0 (dropout_p={dropout_p!r}): "
                         f"pass an integer in [0, 2**64)")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def dropout_keep_threshold(dropout_p):
    """The keep rule's bound: an element is kept iff its Philox word is below it.

    min(int((1 - dropout_p) * 2**32), 2**32 - 1), (1 - dropout_p) in float64 and int()
    truncating, so the kernel can compute the same 32-bit integer from the same double.
    """
    p = check_dropout_p(dropout_p)
    # 2**32 itself does not fit in a 32-bit word: p = 0 keeps words up to 2**32 - 2 only,
    # which is why dropout_p = 0 means "no dropout" rather than this rule.
    return min(int((1.0 - p) * 2**32), 2**32 - 1)


def _philox_keep(seed, threshold, batch_index, nheads, i, j):
    """Keep mask (len(batch_index), nheads, len(i), len(j)) of the score elements at those coordinates.

    batch_index, i and j are 1-D integer arrays (absolute batch, row and column indices).
    """
    batch_index, i, j = (np.asarray(x, dtype=np.int64) for x in (batch_index, i, j))
    batch_head = (batch_index[:, None] * nheads + np.arange(nheads)[None, :])[:, :, None, None]
    i, j = i[:, None], j[None, :]
    # One Philox call covers the 4 elements (i, j), (i, j+1), (i+8, j), (i+8, j+1) that one
    # thread holds in the mma.m16n8k16 accumulator fragment (i with bit 3 clear, j even), so the
    # counter drops j's bit 0 and i's bit 3, and those two bits pick the word.
    words = philox4x32_10((j & ~1, i & ~8, batch_head, 0), (seed & 0xFFFFFFFF, seed >> 32))
    word_index = 2 * ((i >> 3) & 1) + (j & 1)
    return np.choose(word_index, words) < threshold


def dropout_keep_mask(seed, dropout_p, batch, nheads, seqlen_q, seqlen_k):
    """Bool array (batch, nheads, seqlen_q, seqlen_k): which attention probabilities dropout keeps.

    Element (b, h, i, j) takes word 2 * ((i >> 3) & 1) + (j & 1) of
    philox4x32_10((j & ~1, i & ~8, b * nheads + h, 0), (seed & 0xffffffff, seed >> 32))
    and is kept iff that word < dropout_keep_threshold(dropout_p). The mask of an element does
    not depend on seqlen_q or seqlen_k. (For varlen, b is the sequence index and i, j are
    positions inside the sequence.) This applies the rule even at dropout_p = 0, where the
    attention functions apply no dropout at all.
    """
    threshold = dropout_keep_threshold(dropout_p)
    seed = check_seed(seed, dropout_p)
    for name, size in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {size!r}")
    return _philox_keep(seed, threshold, np.arange(batch), nheads, np.arange(seqlen_q), np.arange(seqlen_k))


class _Dropout(NamedTuple):
    """The validated dropout settings of one call (None stands for no dropout)."""
    seed: int
    threshold: int
    rescale: float  # 1 / (1 - dropout_p): the kept probabilities are scaled up by it
    first_batch: int  # Philox batch index of the call's batch 0 (varlen: the sequence's index)

    def keep(self, batch, nheads, seqlen_q, seqlen_k, rows=slice(None), cols=slice(None)):
        """Keep mask (batch, nheads, m, n) of query rows `rows` against keys `cols` (slices)."""
        return _philox_keep(self.seed, self.threshold, self.first_batch + np.arange(batch), nheads,
                            np.arange(seqlen_q)[rows], np.arange(seqlen_k)[cols])


def _check_dropout(dropout_p, seed):
    """_Dropout for the call, or None when dropout_p is 0 (then seed is ignored)."""
    p = check_dropout_p(dropout_p)
    if p == 0:
        return None
    return _Dropout(check_seed(seed, dropout_p), dropout_keep_threshold(p), 1.0 / (1.0 - p), 0)


def _dropped(x, keep, rescale):
    """x * keep / (1 - dropout_p) in x's dtype: dropout, or its backward, applied to x."""
    return np.where(keep, x * np.asarray(rescale, dtype=x.dtype), np.zeros((), dtype=x.dtype))


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
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap!r}") from None
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


# ---------------------------------------------------------------------------
# Naive float64 attention.
# ---------------------------------------------------------------------------

def attention_forward(q, k, v, softmax_scale=None, causal=False, *, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, attn_bias=None, dropout_p=0.0, seed=None):
    """Naive attention in float64. Returns (out, lse).

    With dropout, out = (P * M / (1 - dropout_p)) @ V for P the softmax and M the keep mask;
    lse stays the log-sum-exp of the scores.
    """
    return _forward(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias,
                    _check_dropout(dropout_p, seed))


def _forward(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias, dropout):
    """attention_forward with the dropout settings already checked (varlen sets first_batch)."""
    qh, kh, vh, scale, opts = _setup(q, k, v, softmax_scale, None, causal, window_size, softcap,
                                     alibi_slopes, attn_bias)
    s, _ = _scores(qh, kh, scale, opts)
    p, lse = _softmax(s)
    if dropout is not None:
        p = _dropped(p, dropout.keep(*s.shape), dropout.rescale)
    return _seq_first(p @ vh), lse


def attention_backward(dout, q, k, v, softmax_scale=None, causal=False, *, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, attn_bias=None, return_dbias=False, dropout_p=0.0, seed=None):
    """Analytic gradient of attention_forward in float64. Returns (dq, dk, dv).

    dk and dv are summed over the query heads that share each kv head. With return_dbias, also
    returns dbias, the gradient of attn_bias in its own shape (None if attn_bias is None).
    Dropout (same dropout_p and seed as the forward) scales dV's P and dP by M / (1 - dropout_p).
    """
    return _backward(dout, q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias,
                     return_dbias, _check_dropout(dropout_p, seed))


def _backward(dout, q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias,
              return_dbias, dropout):
    """attention_backward with the dropout settings already checked."""
    nheads_k = np.shape(k)[2]
    qh, kh, vh, scale, opts = _setup(q, k, v, softmax_scale, None, causal, window_size, softcap,
                                     alibi_slopes, attn_bias)
    doh = _heads_first(dout)
    s, t = _scores(qh, kh, scale, opts)
    p, _ = _softmax(s)

    keep = None if dropout is None else dropout.keep(*s.shape)
    p_used = p if keep is None else _dropped(p, keep, dropout.rescale)  # what multiplied V
    dv = p_used.swapaxes(-1, -2) @ doh
    dp = doh @ vh.swapaxes(-1, -2)
    if keep is not None:
        dp = _dropped(dp, keep, dropout.rescale)  # now the gradient of P itself
    # Softmax backward: dS = P * (dP - rowsum(dP * P)), the gradient of the final logits,
    # which is also the gradient of the bias added to them.
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dbias = ds
    if t is not None:
        ds = ds * (1 - t * t)  # through softcap: d/dx softcap * tanh(x / softcap) = 1 - tanh^2
    dq = ds @ kh * scale
    dk = ds.swapaxes(-1, -2) @ qh * scale
    return _with_dbias(_grads_to_layout(dq, dk, dv, nheads_k), dbias, opts, return_dbias)


# ---------------------------------------------------------------------------
# FlashAttention-2, tile by tile (float64 teaching version of the kernels).
# ---------------------------------------------------------------------------

def _blocks(length, block):
    """Slices that cut range(length) into blocks of `block` (the last may be shorter)."""
    if block < 1:
        raise ValueError(f"block size must be positive, got {block}")
    return [slice(start, min(start + block, length)) for start in range(0, length, block)]


def attention_forward_tiled(q, k, v, softmax_scale=None, causal=False, block_m=64, block_n=64, *,
                            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_bias=None,
                            dropout_p=0.0, seed=None):
    """FlashAttention forward: online softmax over key tiles. Returns (out, lse).

    Only the key tiles in key_block_range are visited; the others are fully masked. Dropout's
    mask is recomputed per tile from the Philox counter, as the kernel does.
    """
    dropout = _check_dropout(dropout_p, seed)
    qh, kh, vh, scale, opts = _setup(q, k, v, softmax_scale, None, causal, window_size, softcap,
                                     alibi_slopes, attn_bias)
    batch, nheads, seqlen_q, _ = qh.shape
    seqlen_k, headdim_v = kh.shape[2], vh.shape[3]
    key_blocks = _blocks(seqlen_k, block_n)
    out = np.empty((batch, nheads, seqlen_q, headdim_v))
    lse = np.empty((batch, nheads, seqlen_q))

    for rows in _blocks(seqlen_q, block_m):  # one thread block per query tile
        n_rows = rows.stop - rows.start
        row_max = np.full((batch, nheads, n_rows), -np.inf)  # max of S * log2(e) so far
        row_sum = np.zeros((batch, nheads, n_rows))  # sum of exp2(S * log2(e) - row_max)
        acc = np.zeros((batch, nheads, n_rows, headdim_v))  # unnormalised output

        # Tiles outside the window (or right of the causal diagonal) are never loaded.
        for n in key_block_range(rows, seqlen_q, seqlen_k, block_n, window_size=opts.window_size):
            cols = key_blocks[n]
            if tile_hook is not None:
                tile_hook("forward", rows, cols)
            # The kernel works in base 2: exp2 is a single instruction, and log2(e) folds into the scale.
            s, _ = _scores(qh, kh, scale, opts, rows, cols, log2=True)
            new_max = np.maximum(row_max, s.max(axis=-1))
            # A row with no visible key so far keeps max -inf; use 0 so exp2 gives 0, not NaN.
            safe_max = np.where(np.isneginf(new_max), 0.0, new_max)
            # Everything summed so far was relative to the old max: rescale it to the new one.
            correction = np.exp2(row_max - safe_max)
            p = np.exp2(s - safe_max[..., None])
            # The softmax denominator sums every probability, dropped or not.
            row_sum = row_sum * correction + p.sum(axis=-1)
            if dropout is not None:
                # Only the kept probabilities reach V; the 1 / (1 - dropout_p) waits for the end.
                p = np.where(dropout.keep(batch, nheads, seqlen_q, seqlen_k, rows, cols), p, 0.0)
            acc = acc * correction[..., None] + p @ vh[:, :, cols]
            row_max = new_max

        # Normalise once at the end instead of on every tile.
        has_keys = row_sum > 0
        out[:, :, rows] = acc / np.where(has_keys, row_sum, 1.0)[..., None]
        if dropout is not None:
            out[:, :, rows] *= dropout.rescale
        with np.errstate(divide="ignore"):
            # row_max is max(S) * log2(e), so row_max * ln(2) = max(S).
            lse[:, :, rows] = np.where(has_keys, row_max * LN2 + np.log(row_sum), -np.inf)

    return _seq_first(out), lse


def attention_backward_tiled(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                             block_m=64, block_n=64, *, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, attn_bias=None, return_dbias=False, dropout_p=0.0,
                             seed=None):
    """FlashAttention-2 backward: key tiles outside, query tiles inside. Returns (dq, dk, dv).

    P is recomputed from the saved lse instead of being stored, and so is dropout's mask (from
    the seed). Only the query tiles in query_block_range of each key tile are visited. With
    return_dbias, also returns dbias (None if attn_bias is None), written tile by tile.
    """
    dropout = _check_dropout(dropout_p, seed)
    nheads_k = np.shape(k)[2]
    qh, kh, vh, scale, opts = _setup(q, k, v, softmax_scale, None, causal, window_size, softcap,
                                     alibi_slopes, attn_bias)
    doh = _heads_first(dout)
    batch, nheads, seqlen_q, _ = qh.shape
    seqlen_k = kh.shape[2]
    query_blocks = _blocks(seqlen_q, block_m)
    lse = np.asarray(lse, dtype=np.float64)
    # Empty rows have lse = -inf; +inf instead makes exp(S - lse) = 0 there, not NaN.
    lse_for_p = np.where(np.isneginf(lse), np.inf, lse)
    # D_i = rowsum(dO * O) = rowsum(dP * P): computed once up front, so the loop never needs
    # a whole row of P. (With dropout O is the dropped output and dP the gradient of P
    # itself, and the identity still holds.)
    delta = (doh * _heads_first(out)).sum(axis=-1)

    dq = np.zeros_like(qh)
    dk = np.zeros_like(kh)
    dv = np.zeros_like(vh)
    want_dbias = return_dbias and opts.attn_bias is not None
    dbias = np.zeros((batch, nheads, seqlen_q, seqlen_k)) if want_dbias else None
    for cols in _blocks(seqlen_k, block_n):  # one thread block per key tile
        k_tile, v_tile = kh[:, :, cols], vh[:, :, cols]
        # dk, dv of this key tile stay in registers for the whole inner loop.
        dk_acc = np.zeros_like(k_tile)
        dv_acc = np.zeros_like(v_tile)

        # Query tiles that see none of these keys are skipped (their gradients here are zero).
        for m in query_block_range(cols, seqlen_q, seqlen_k, block_m, window_size=opts.window_size):
            rows = query_blocks[m]
            if tile_hook is not None:
                tile_hook("backward", rows, cols)
            q_tile, do_tile = qh[:, :, rows], doh[:, :, rows]
            s, t = _scores(qh, kh, scale, opts, rows, cols)
            p = np.exp(s - lse_for_p[:, :, rows, None])
            keep = None if dropout is None else dropout.keep(batch, nheads, seqlen_q, seqlen_k, rows, cols)
            p_used = p if keep is None else _dropped(p, keep, dropout.rescale)  # what multiplied V
            dv_acc += p_used.swapaxes(-1, -2) @ do_tile
            dp = do_tile @ v_tile.swapaxes(-1, -2)
            if keep is not None:
                dp = _dropped(dp, keep, dropout.rescale)
            ds = p * (dp - delta[:, :, rows, None])  # gradient of the final logits (= of the bias)
            if dbias is not None:
                dbias[:, :, rows, cols] = ds
            if t is not None:
                ds = ds * (1 - t * t)  # through softcap
            dk_acc += ds.swapaxes(-1, -2) @ q_tile * scale
            # Several key tiles write the same dq rows: the kernel adds atomically in float32.
            dq[:, :, rows] += ds @ k_tile * scale

        dk[:, :, cols] = dk_acc
        dv[:, :, cols] = dv_acc

    return _with_dbias(_grads_to_layout(dq, dk, dv, nheads_k), dbias, opts, return_dbias)


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


def _lowp_scores_and_probs(q, k, v, dtype, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           attn_bias):
    """Shared start of the low-precision forward and backward."""
    round_fn = lambda x: round_to(x, dtype)  # noqa: E731
    qh, kh, vh, scale, opts = _setup(q, k, v, softmax_scale, round_fn, causal, window_size, softcap,
                                     alibi_slopes, attn_bias)
    s, t = _scores(qh, kh, scale, opts, round_fn=round_fn)
    # Frameworks upcast softmax to float32 and store its result in the tensor's dtype.
    p, lse = _softmax(s)
    return qh, kh, vh, scale, opts, t, round_to(p, dtype), lse, round_fn


def attention_forward_lowp(q, k, v, dtype, softmax_scale=None, causal=False, return_lse=False, *,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_bias=None,
                           dropout_p=0.0, seed=None):
    """Attention as a framework computes it on float16 / bfloat16 tensors.

    Inputs are rounded to dtype; every matrix product and elementwise op (scale, softcap's
    divide / tanh / multiply, bias add) runs in float32 and its result is rounded to dtype; the
    bias (ALiBi plus attn_bias) is itself rounded to dtype first; softmax runs in float32.
    Dropout multiplies the rounded probabilities by M / (1 - dropout_p) in float32 and rounds.
    Returns out as float32 values representable in dtype (and, with return_lse, the log-sum-exp
    of the rounded scores). Empty rows give 0 (a framework would give NaN).
    """
    return _forward_lowp(q, k, v, dtype, softmax_scale, causal, return_lse, window_size, softcap,
                         alibi_slopes, attn_bias, _check_dropout(dropout_p, seed))


def _forward_lowp(q, k, v, dtype, softmax_scale, causal, return_lse, window_size, softcap, alibi_slopes,
                  attn_bias, dropout):
    """attention_forward_lowp with the dropout settings already checked."""
    _, _, vh, _, _, _, p, lse, round_fn = _lowp_scores_and_probs(
        q, k, v, dtype, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias)
    if dropout is not None:
        p = round_fn(_dropped(p, dropout.keep(*p.shape), dropout.rescale))
    out = _seq_first(round_fn(p @ vh))
    return (out, lse) if return_lse else out


def attention_backward_lowp(dout, q, k, v, dtype, softmax_scale=None, causal=False, *, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, attn_bias=None, return_dbias=False,
                            dropout_p=0.0, seed=None):
    """Gradient of attention_forward_lowp, as autograd computes it in dtype. Returns (dq, dk, dv).

    Each product is float32 then rounded; the softmax backward is float32 then rounded; so is
    each step back through softcap, and dropout's scaling of dP. With return_dbias, also returns
    dbias (summed in float32 over attn_bias's broadcast axes, then rounded; None if attn_bias
    is None).
    """
    return _backward_lowp(dout, q, k, v, dtype, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          attn_bias, return_dbias, _check_dropout(dropout_p, seed))


def _backward_lowp(dout, q, k, v, dtype, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   attn_bias, return_dbias, dropout):
    """attention_backward_lowp with the dropout settings already checked."""
    nheads_k = np.shape(k)[2]
    qh, kh, vh, scale, opts, t, p, _, round_fn = _lowp_scores_and_probs(
        q, k, v, dtype, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias)
    doh = _heads_first(dout, round_fn)

    keep = None if dropout is None else dropout.keep(*p.shape)
    # The forward's dropout output, recomputed as autograd would have saved it.
    p_used = p if keep is None else round_fn(_dropped(p, keep, dropout.rescale))
    dv = round_fn(p_used.swapaxes(-1, -2) @ doh)
    dp = round_fn(doh @ vh.swapaxes(-1, -2))
    if keep is not None:
        dp = round_fn(_dropped(dp, keep, dropout.rescale))  # dropout's backward, one more rounding
    ds = round_fn(p * (dp - (dp * p).sum(axis=-1, keepdims=True)))
    dbias = ds
    if t is not None:
        # Autograd retraces softcap * tanh(x / softcap) one op at a time.
        cap = np.float32(opts.softcap)
        ds = round_fn(ds * cap)
        ds = round_fn(ds * (1 - t * t))
        ds = round_fn(ds / cap)
    # The forward scaled S = q k^T after the product, so autograd scales dS before the products.
    ds = round_fn(ds * np.float32(scale))
    dq = round_fn(ds @ kh)
    dk = round_fn(ds.swapaxes(-1, -2) @ qh)
    # Gradients of repeated kv heads are summed in float32, then stored in dtype.
    dq, dk, dv = _grads_to_layout(dq, dk, dv, nheads_k)
    return _with_dbias((dq, round_fn(dk), round_fn(dv)), dbias, opts, return_dbias, round_fn)


# ---------------------------------------------------------------------------
# Variable-length (packed) batches: flash_attn's varlen layout. Sequence b holds rows
# cu_seqlens[b]:cu_seqlens[b + 1] of the packed arrays and is computed as its own batch-1 problem.
# ---------------------------------------------------------------------------

def check_cu_seqlens(name, cu_seqlens, batch, total):
    """Check the cumulative sequence lengths `name` (a host array); returns it as a NumPy array.

    It must be a 1-D int32 array of length batch + 1 (any length >= 1 when batch is None) that
    starts at 0, never decreases and ends at total, the packed length. TypeError for a wrong
    type or dtype, ValueError for the rest; every message names the argument.
    """
    dtype = getattr(cu_seqlens, "dtype", None)
    if dtype is None:
        raise TypeError(f"{name} must be an int32 array, got {type(cu_seqlens).__name__}")
    if dtype != np.int32:
        raise TypeError(f"{name} must be an int32 array, got dtype {dtype}")
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1:
        raise ValueError(f"{name} must be 1-D (batch + 1,), got shape {cu.shape}")
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"{name} must have length batch + 1 = {batch + 1}, got {cu.shape[0]}")
    if cu.shape[0] < 1:
        raise ValueError(f"{name} must have length batch + 1 >= 1, got an empty array")
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
    # int64 so that the differences of extreme int32 values cannot wrap around.
    lengths = np.diff(cu.astype(np.int64))
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise ValueError(f"{name} must be non-decreasing, got {name}[{b}] = {cu[b]} > "
                         f"{name}[{b + 1}] = {cu[b + 1]}")
    if cu[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {name}[-1] = {cu[-1]}")
    return cu


def check_max_seqlen(name, max_seqlen, cu_seqlens):
    """Check that the integer `name` bounds every sequence of cu_seqlens (as checked by
    check_cu_seqlens); ValueError if not."""
    if isinstance(max_seqlen, (bool, np.bool_)) or not isinstance(max_seqlen, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {max_seqlen!r}")
    lengths = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    longest = int(lengths.max()) if lengths.size else 0
    if max_seqlen < longest or max_seqlen < 0:
        raise ValueError(f"{name} must be >= the longest sequence ({longest}), got {max_seqlen!r}")


class _Sequence(NamedTuple):
    """One sequence of a varlen call: its rows in the packed q and k, and its own options."""
    rows_q: slice
    rows_k: slice
    alibi_slopes: object  # (nheads,) or None
    dropout: object  # _Dropout with first_batch = the sequence index, or None

    def batch_of_one(self, q_packed, kv_packed):
        """This sequence's rows of packed arrays laid out like q, then of those laid out like k,
        each with a leading batch axis of 1 (the dense layout)."""
        return [x[None, self.rows_q] for x in q_packed] + [x[None, self.rows_k] for x in kv_packed]


def _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, dropout_p, seed, dout=None):
    """Validate a varlen call; returns (q, k, v, dout, scale, sequences), the arrays as NumPy arrays.

    sequences lists only those with at least one query and one key: the others need no work
    (their rows keep out 0, lse -inf and zero gradients, as a dense call would give them).
    """
    dropout = _check_dropout(dropout_p, seed)
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"varlen q, k, v must be 3-d: (total, nheads, headdim), got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape or k.shape[2] != q.shape[2]:
        raise ValueError(f"incompatible varlen shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"nheads ({q.shape[1]}) must be a multiple of nheads_k ({k.shape[1]})")
    if dout is not None:
        dout = np.asarray(dout)
        if dout.shape != q.shape:
            raise ValueError(f"dout must have q's shape {q.shape}, got {dout.shape}")
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q.shape[0])
    batch = cu_q.shape[0] - 1
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch, k.shape[0])
    nheads, headdim = q.shape[1:]
    # Checked once here, so a call whose sequences are all empty still rejects bad options.
    opts = _check_options((batch, 1, nheads, headdim), 1, causal, window_size, softcap, alibi_slopes, None)
    if softmax_scale is None:
        softmax_scale = headdim ** -0.5
    sequences = []
    for b in range(batch):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rows_k = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows_q.start == rows_q.stop or rows_k.start == rows_k.stop:
            continue
        slopes = None
        if opts.alibi_slopes is not None:
            # (1 or batch, nheads, 1, 1): slopes given as (batch, nheads) give sequence b row b.
            slopes = opts.alibi_slopes[b if opts.alibi_slopes.shape[0] == batch else 0, :, 0, 0]
        seq_dropout = None if dropout is None else dropout._replace(first_batch=b)
        sequences.append(_Sequence(rows_q, rows_k, slopes, seq_dropout))
    return q, k, v, dout, float(softmax_scale), sequences


def attention_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, *,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                             seed=None):
    """Naive float64 attention over packed sequences. Returns (out, lse).

    q is (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim); cu_seqlens_q and
    cu_seqlens_k are int32 (batch + 1,) (see check_cu_seqlens). out is (total_q, nheads, headdim),
    lse (nheads, total_q). Each sequence is attention_forward on a batch of one, its masks aligned
    to its own bottom-right corner; alibi_slopes is (nheads,) or (batch, nheads); dropout uses
    the sequence index as the batch index of the Philox counter.
    """
    q, k, v, _, scale, sequences = _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                                 window_size, softcap, alibi_slopes, dropout_p, seed)
    out = np.zeros(q.shape[:2] + v.shape[2:])
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for seq in sequences:
        out_b, lse_b = _forward(*seq.batch_of_one((q,), (k, v)), scale, causal, window_size, softcap,
                                seq.alibi_slopes, None, seq.dropout)
        out[seq.rows_q], lse[:, seq.rows_q] = out_b[0], lse_b[0]
    return out, lse


def attention_backward_varlen(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, *,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                              seed=None):
    """Gradient of attention_forward_varlen in float64. Returns (dq, dk, dv), packed like q, k, v."""
    q, k, v, dout, scale, sequences = _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                                    causal, window_size, softcap, alibi_slopes, dropout_p,
                                                    seed, dout)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for seq in sequences:
        grads = _backward(*seq.batch_of_one((dout, q), (k, v)), scale, causal, window_size, softcap,
                          seq.alibi_slopes, None, False, seq.dropout)
        dq[seq.rows_q], dk[seq.rows_k], dv[seq.rows_k] = (g[0] for g in grads)
    return dq, dk, dv


def attention_forward_varlen_lowp(q, k, v, cu_seqlens_q, cu_seqlens_k, dtype, softmax_scale=None,
                                  causal=False, return_lse=False, *, window_size=(-1, -1), softcap=0.0,
                                  alibi_slopes=None, dropout_p=0.0, seed=None):
    """attention_forward_lowp over packed sequences: out (total_q, nheads, headdim) as float32
    values representable in dtype, and with return_lse the float32 lse (nheads, total_q)."""
    _format_name(dtype)
    q, k, v, _, scale, sequences = _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                                 window_size, softcap, alibi_slopes, dropout_p, seed)
    out = np.zeros(q.shape[:2] + v.shape[2:], dtype=np.float32)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf, dtype=np.float32)
    for seq in sequences:
        out_b, lse_b = _forward_lowp(*seq.batch_of_one((q,), (k, v)), dtype, scale, causal, True, window_size,
                                     softcap, seq.alibi_slopes, None, seq.dropout)
        out[seq.rows_q], lse[:, seq.rows_q] = out_b[0], lse_b[0]
    return (out, lse) if return_lse else out


def attention_backward_varlen_lowp(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, dtype, softmax_scale=None,
                                   causal=False, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                   dropout_p=0.0, seed=None):
    """Gradient of attention_forward_varlen_lowp: (dq, dk, dv) packed like q, k, v, float32
    values representable in dtype."""
    _format_name(dtype)
    q, k, v, dout, scale, sequences = _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                                    causal, window_size, softcap, alibi_slopes, dropout_p,
                                                    seed, dout)
    dq, dk, dv = (np.zeros(x.shape, dtype=np.float32) for x in (q, k, v))
    for seq in sequences:
        grads = _backward_lowp(*seq.batch_of_one((dout, q), (k, v)), dtype, scale, causal, window_size,
                               softcap, seq.alibi_slopes, None, False, seq.dropout)
        dq[seq.rows_q], dk[seq.rows_k], dv[seq.rows_k] = (g[0] for g in grads)
    return dq, dk, dv
