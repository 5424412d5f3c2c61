"""Ring attention's schedule, shared by cupyflash.torch and cupyflash.jax: which pieces of attention a
rank computes at each step of the ring, for the sequence layouts over N ranks:
  "contiguous": rank r holds chunk r of N;
  "zigzag": the sequence cut into 2N chunks, rank r holds chunks r and 2N - 1 - r, so that under a
    causal mask every rank does the same work at every step.
"""

import dataclasses

from . import options, validate

LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One flash_attn_func call of a ring step: q rows [q0, q1) against k/v rows [k0, k1) of the
    slices at hand (None: to the end), causal or not."""
    q0: int
    q1: object
    k0: int
    k1: object
    causal: bool


def ring_steps(rank, source, world, causal, layout, seqlen_local):
    """The pieces of the step where `rank` holds the K/V slice of rank `source`: under a causal mask
    chunks before a query chunk are seen whole, its own chunk with the diagonal, later ones not at all."""
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


def check_arguments(q, k, v, softmax_scale, causal, softcap, layout):
    """(scale, causal, softcap) of a ring call, after the checks both frameworks share."""
    check_layout(layout)
    if q.shape[1] != k.shape[1] or k.shape != v.shape:
        raise ValueError(f"q, k and v must hold the same slice of the sequence: got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"a zigzag slice holds two equal chunks: its length must be even, got {q.shape[1]}")
    return (validate.check_scale(softmax_scale, q.shape[-1]), validate.check_flag("causal", causal),
            options.by_name("softcap").check(softcap, None))
