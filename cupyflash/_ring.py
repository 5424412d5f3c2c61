"""Ring attention's schedule, shared by cupyflash.torch and cupyflash.jax: which pieces of attention a
rank computes at each step of the ring, for the sequence layouts over N ranks:
  "contiguous": rank r holds chunk r of N;
  "zigzag": the sequence cut into 2N chunks, rank r holds chunks r and 2N - 1 - r, so that under a
    causal mask every rank does the same work at every step.
"""

import dataclasses
from typing import NamedTuple

from . import options, validate

LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One flash_attn_func call of a ring step: q rows [q0, q1) against k/v rows [k0, k1) of the
    slices at hand (None: to the end), causal or not, and its window_size (bottom-right aligned on
    the piece, as flash_attn_func aligns it)."""
    q0: int
    q1: object
    k0: int
    k1: object
    causal: bool
    window_size: tuple = (-1, -1)


def ring_steps(rank, source, world, causal, layout, seqlen_local, window_size=(-1, -1)):
    """The pieces of the step where `rank` holds the K/V slice of rank `source`. Without a window:
    under a causal mask chunks before a query chunk are seen whole, its own chunk with the diagonal,
    later ones not at all. With one (window_size as flash_attn_func's, over global positions): each
    pair of held chunks, trimmed to the rows and keys that see one another (window_piece)."""
    left, right = options.window_bounds(causal, window_size)
    if left >= 0 or (right >= 0 and not causal):
        return _window_steps(rank, source, world, layout, seqlen_local, left, right)
    if not causal:
        return [Piece(0, None, 0, None, False)]
    if source == rank:
        return [Piece(0, None, 0, None, True)]  # (zigzag: the local order of positions is the global one)
    if layout == "contiguous":
        return [Piece(0, None, 0, None, False)] if source < rank else []
    half = seqlen_local // 2
    if source < rank:  # both query chunks see the source's first chunk, and neither its second
        return [Piece(0, None, 0, half, False)]
    return [Piece(half, None, 0, None, False)]  # only the second query chunk, which sees both


def _held_chunks(rank, world, layout, seqlen_local):
    """([(global position, local position)] of the chunks `rank` holds, their length)."""
    order = chunk_order(world, layout)
    per_rank = len(order) // world
    size = seqlen_local // per_rank
    return [(c * size, i * size) for i, c in enumerate(order[rank * per_rank:(rank + 1) * per_rank])], size


def _window_steps(rank, source, world, layout, seqlen_local, left, right):
    rows, size = _held_chunks(rank, world, layout, seqlen_local)
    keys, _ = _held_chunks(source, world, layout, seqlen_local)
    pieces = []
    for q_global, q_local in rows:
        for k_global, k_local in keys:
            piece = window_piece(q_global, q_global + size, k_global, k_global + size, left, right)
            if piece is not None:
                qa, qb, ka, kb, window = piece
                shift_q, shift_k = q_local - q_global, k_local - k_global
                pieces.append(Piece(qa + shift_q, qb + shift_q, ka + shift_k, kb + shift_k, False, window))
    return pieces


def window_piece(qa, qb, ka, kb, left, right):
    """Rows [qa, qb) against keys [ka, kb) (global positions; row p sees keys p - left .. p + right,
    -1 unbounded), trimmed to the rows and keys that see one another: (qa, qb, ka, kb, window_size)
    with window_size the one flash_attn_func needs for them (bottom-right aligned on the piece; the
    trimming keeps its sides >= 0), or None where none sees another."""
    while True:
        before = qa, qb, ka, kb
        if left >= 0:
            ka, qb = max(ka, qa - left), min(qb, kb + left)
        if right >= 0:
            kb, qa = min(kb, qb + right), max(qa, ka - right)
        if qa >= qb or ka >= kb:
            return None
        if (qa, qb, ka, kb) == before:
            break
    # The piece's diagonal (bottom-right) sits `end` keys left of the global one.
    end = qb - kb
    piece_left, piece_right = (left - end if left >= 0 else -1), (right + end if right >= 0 else -1)
    if (piece_left < 0 or piece_left >= kb - ka - 1) and (piece_right < 0 or piece_right >= qb - qa - 1):
        piece_left = piece_right = -1  # every row sees every key
    return qa, qb, ka, kb, (piece_left, piece_right)


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")


def chunk_order(world, layout):
    """The sequence's chunks in the order the ranks hold them (rank r's slice is the r-th run of
    len(order) / world of them): its chunks are len(order) equal parts of the sequence."""
    check_layout(layout)
    if layout == "contiguous":
        return list(range(world))
    return [c for r in range(world) for c in (r, 2 * world - 1 - r)]


class Settings(NamedTuple):
    """A ring call's checked attention options."""
    scale: float
    causal: bool
    softcap: float
    window_size: tuple


def check_arguments(q, k, v, softmax_scale, causal, softcap, layout, window_size=(-1, -1)):
    """The Settings of a ring call, after the checks both frameworks share."""
    check_layout(layout)
    options.window_bounds(causal, window_size)  # raises on a bad window
    if q.shape[1] != k.shape[1] or k.shape != v.shape:
        raise ValueError(f"q, k and v must hold the same slice of the sequence: got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"a zigzag slice holds two equal chunks: its length must be even, got {q.shape[1]}")
    return Settings(validate.check_scale(softmax_scale, q.shape[-1]), validate.check_flag("causal", causal),
                    options.by_name("softcap").check(softcap, None), tuple(int(side) for side in window_size))
