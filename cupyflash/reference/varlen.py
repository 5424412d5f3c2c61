"""Variable-length (packed) batches, flash_attn's varlen layout: sequence b holds rows
cu_seqlens[b]:cu_seqlens[b + 1] of the packed arrays and is computed as its own batch-1 problem."""

from typing import NamedTuple

import numpy as np

from ..validate import check_cu_seqlens
from ._common import _check_options
from .lowp import _backward_lowp, _format_name, _forward_lowp
from .naive import _backward, _forward
from .philox import _check_dropout


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
                              seed=None, out=None, lse=None):
    """Gradient of attention_forward_varlen in float64. Returns (dq, dk, dv), packed like q, k, v.
    out and lse (nheads, total_q), where given, are the forward's, taken as attention_backward takes them."""
    q, k, v, dout, scale, sequences = _varlen_setup(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                                    causal, window_size, softcap, alibi_slopes, dropout_p,
                                                    seed, dout)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for seq in sequences:
        stats = (None, None)
        if lse is not None:
            stats = np.asarray(out)[None, seq.rows_q], np.asarray(lse)[None, :, seq.rows_q]
        grads = _backward(*seq.batch_of_one((dout, q), (k, v)), scale, causal, window_size, softcap,
                          seq.alibi_slopes, None, False, seq.dropout, *stats)
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
