"""Dropout: a Philox4x32-10 counter-based RNG, so that the mask of any score element can be
recomputed anywhere (forward, backward, a tile, the GPU) from its coordinates and the seed."""

import numbers
from typing import NamedTuple

import numpy as np

from ..options import DROPOUT_BITS, check_dropout_p, check_seed, dropout_keep_threshold, dropout_rescale

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


def _philox_keep(seed, threshold, batch_index, nheads, i, j):
    """Keep mask (len(batch_index), nheads, len(i), len(j)) of the score elements at those coordinates.

    batch_index, i and j are 1-D integer arrays (absolute batch, row and column indices).
    """
    batch_index, i, j = (np.asarray(x, dtype=np.int64) for x in (batch_index, i, j))
    batch_head = (batch_index[:, None] * nheads + np.arange(nheads)[None, :])[:, :, None, None]
    # One Philox call covers the 16 elements whose rows and columns agree but in bits 0 and 3, so
    # that a call serves two neighbouring accumulator tiles of a lane pair (common/score.cuh); bit 0
    # of the row and the column picks the word, bit 3 of each the byte in it. Each call is made
    # once, for the distinct (row, column) counters, and its words handed to its elements.
    call_rows, row_call = np.unique(i & ~9, return_inverse=True)
    call_cols, col_call = np.unique(j & ~9, return_inverse=True)
    words = philox4x32_10((call_cols[None, :], call_rows[:, None], batch_head, 0), (seed & 0xFFFFFFFF, seed >> 32))
    i, j = i[:, None], j[None, :]
    word = np.moveaxis(words, 0, -1)[..., row_call.reshape(-1, 1), col_call.reshape(1, -1), 2 * (i & 1) + (j & 1)]
    byte = 2 * ((i >> 3) & 1) + ((j >> 3) & 1)
    bits = (word >> (DROPOUT_BITS * byte).astype(np.uint32)) & np.uint32(2 ** DROPOUT_BITS - 1)
    return bits < threshold


def dropout_keep_mask(seed, dropout_p, batch, nheads, seqlen_q, seqlen_k):
    """Bool array (batch, nheads, seqlen_q, seqlen_k): which attention probabilities dropout keeps.

    Element (b, h, i, j) takes byte 2 * ((i >> 3) & 1) + ((j >> 3) & 1) (bits 8 * byte to
    8 * byte + 7; DROPOUT_BITS is 8) of word 2 * (i & 1) + (j & 1) of
    philox4x32_10((j & ~9, i & ~9, b * nheads + h, 0), (seed & 0xffffffff, seed >> 32))
    and is kept iff that byte is below dropout_keep_threshold(dropout_p); the kept ones are scaled
    by dropout_rescale(dropout_p). The mask of an element does not depend on seqlen_q or seqlen_k.
    (For varlen, b is the sequence index and i, j are positions inside the sequence.) This applies
    the rule even at dropout_p = 0, where the attention functions apply no dropout at all.
    """
    threshold = dropout_keep_threshold(check_dropout_p(dropout_p))
    seed = check_seed(seed, dropout_p)
    for name, size in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {size!r}")
    return _philox_keep(seed, threshold, np.arange(batch), nheads, np.arange(seqlen_q), np.arange(seqlen_k))


class _Dropout(NamedTuple):
    """The validated dropout settings of one call (None stands for no dropout)."""
    seed: int
    threshold: int
    rescale: float  # dropout_rescale(dropout_p): the kept probabilities are scaled up by it
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
    return _Dropout(check_seed(seed, dropout_p), dropout_keep_threshold(p), dropout_rescale(p), 0)


def _dropped(x, keep, rescale):
    """x * keep * rescale in x's dtype: dropout, or its backward, applied to x."""
    return np.where(keep, x * np.asarray(rescale, dtype=x.dtype), np.zeros((), dtype=x.dtype))
