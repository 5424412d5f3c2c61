"""FlashAttention-2, tile by tile: a float64 teaching version of the kernels."""

import numpy as np

from ._common import (LN2, _grads_to_layout, _heads_first, _scores, _seq_first, _setup, _with_dbias,
                      key_block_range, query_block_range)
from .philox import _check_dropout, _dropped

# Called as tile_hook(pass_name, rows, cols) for every tile the tiled functions compute
# ("forward" or "backward"; rows and cols are slices). Tests use it to see which tiles are skipped.
tile_hook = None


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
                # Only the kept probabilities reach V; the rescale waits for the end.
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
