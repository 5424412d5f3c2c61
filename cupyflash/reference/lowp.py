"""Low-precision emulation: the same attention with every operation rounded to float16 or
bfloat16, the yardstick of the GPU tests' tolerances."""

import numpy as np

from ._common import _grads_to_layout, _heads_first, _scores, _seq_first, _setup, _softmax, _with_dbias
from .philox import _check_dropout, _dropped


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

    Rounds straight from x's own precision (float32 stays float32; anything else is read as
    float64). (ml_dtypes casts float64 -> bfloat16 through float32, which rounds twice and is
    occasionally one ulp off.) NumPy's float16 casts round once; bfloat16 rounds the bits of
    x's format (ties to even at its last kept bit), below its smallest normal at a fixed spacing.
    """
    name = _format_name(dtype)
    x = np.asarray(x)
    x = np.asarray(x, dtype=np.float32 if x.dtype == np.float32 else np.float64)
    with np.errstate(over="ignore"):
        if name == "float16":
            return x.astype(np.float16).astype(np.float32)
        digits, min_exp, max_finite = _FORMATS[name]
        shape, x = x.shape, np.ascontiguousarray(x).reshape(-1)
        word = np.uint32 if x.dtype == np.float32 else np.uint64
        dropped = np.finfo(x.dtype).nmant - (digits - 1)  # x's mantissa bits below the format's
        bits = x.view(word)
        odd = (bits >> word(dropped)) & word(1)
        kept = word(2 ** (8 * x.itemsize) - 2**dropped)
        rounded = ((bits + word(2 ** (dropped - 1) - 1) + odd) & kept).view(x.dtype)
        if x.dtype == np.float64:  # (bfloat16's subnormals are float32's with 16 low bits clear: bits round them)
            subnormal = np.abs(x) < 2.0**min_exp
            if subnormal.any():
                spacing = 2.0 ** (min_exp - (digits - 1))
                rounded[subnormal] = np.round(x[subnormal] / spacing) * spacing  # np.round: ties to even
        nan = np.isnan(x)
        rounded[nan] = x[nan]
        overflow = np.abs(rounded) > max_finite
        rounded[overflow] = np.copysign(np.inf, rounded[overflow])
        return rounded.astype(np.float32).reshape(shape)


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
    Dropout multiplies the rounded probabilities by M * dropout_rescale(dropout_p) in float32 and rounds.
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
