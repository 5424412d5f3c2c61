"""Naive attention in float64: the full score matrix."""

import numpy as np

from ._common import _grads_to_layout, _heads_first, _scores, _seq_first, _setup, _softmax, _with_dbias
from .philox import _check_dropout, _dropped


def attention_forward(q, k, v, softmax_scale=None, causal=False, *, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, attn_bias=None, dropout_p=0.0, seed=None):
    """Naive attention in float64. Returns (out, lse).

    With dropout, out = (P * M * dropout_rescale(dropout_p)) @ V for P the softmax and M the keep mask;
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
                       alibi_slopes=None, attn_bias=None, return_dbias=False, dropout_p=0.0, seed=None, out=None,
                       lse=None):
    """Analytic gradient of attention_forward in float64. Returns (dq, dk, dv).

    dk and dv are summed over the query heads that share each kv head. With return_dbias, also
    returns dbias, the gradient of attn_bias in its own shape (None if attn_bias is None).
    Dropout (same dropout_p and seed as the forward) scales dV's P and dP by M * dropout_rescale(dropout_p).
    With the forward's out and lse given, the probabilities are exp(scores - lse) and the softmax's
    row term rowsum(dout * out), as the kernels take them: a call over part of the keys (ring
    attention's pieces) then gives that part's share of the whole softmax's gradients.
    """
    return _backward(dout, q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias,
                     return_dbias, _check_dropout(dropout_p, seed), out, lse)


def _backward(dout, q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias,
              return_dbias, dropout, out=None, lse=None):
    """attention_backward with the dropout settings already checked."""
    nheads_k = np.shape(k)[2]
    qh, kh, vh, scale, opts = _setup(q, k, v, softmax_scale, None, causal, window_size, softcap,
                                     alibi_slopes, attn_bias)
    doh = _heads_first(dout)
    s, t = _scores(qh, kh, scale, opts)
    if lse is None:
        p, _ = _softmax(s)
    else:  # rows that saw no key (lse -inf) have no probability
        lse = np.asarray(lse, np.float64)[..., None]
        p = np.where(np.isneginf(lse), 0.0, np.exp(s - np.where(np.isneginf(lse), 0.0, lse)))

    keep = None if dropout is None else dropout.keep(*s.shape)
    p_used = p if keep is None else _dropped(p, keep, dropout.rescale)  # what multiplied V
    dv = p_used.swapaxes(-1, -2) @ doh
    dp = doh @ vh.swapaxes(-1, -2)
    if keep is not None:
        dp = _dropped(dp, keep, dropout.rescale)  # now the gradient of P itself
    # Softmax backward: dS = P * (dP - rowsum(dP * P)), the gradient of the final logits,
    # which is also the gradient of the bias added to them; rowsum(dP * P) = rowsum(dout * out).
    if out is None:
        row = (dp * p).sum(axis=-1, keepdims=True)
    else:
        row = (doh * _heads_first(out)).sum(axis=-1, keepdims=True)
    ds = p * (dp - row)
    dbias = ds
    if t is not None:
        ds = ds * (1 - t * t)  # through softcap: d/dx softcap * tanh(x / softcap) = 1 - tanh^2
    dq = ds @ kh * scale
    dk = ds.swapaxes(-1, -2) @ qh * scale
    return _with_dbias(_grads_to_layout(dq, dk, dv, nheads_k), dbias, opts, return_dbias)
