"""Ring attention (context parallelism) for JAX, inside jax.shard_map over a sequence mesh axis: each
device holds a slice of q, k and v; the K/V slices move around the ring by jax.lax.ppermute, and the
partial outputs merge by their log-sum-exp. Differentiable: the backward moves each slice's dK/dV
accumulator around with it, one step further, back to its owner.

The layouts and each step's pieces are cupyflash/_ring.py's. A device's rank is known only when the
program runs, so a step whose pieces depend on it (causal or windowed) chooses between the distinct
piece lists of the ranks with jax.lax.switch. shard_sequence reorders a whole sequence so that splitting it
into equal blocks along the mesh axis gives each device its slice; unshard_sequence undoes it.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import _ring
from .jax import backward_with_stats, forward_with_lse, varying, varying_axes


def shard_sequence(x, world, layout="zigzag", dim=1):
    """The whole sequence `x` with its chunks in the order `world` devices hold them (block-shard it
    along `dim` over the mesh axis to give each device its slice)."""
    order = _ring.chunk_order(world, layout)
    if x.shape[dim] % len(order):
        raise ValueError(f"the sequence (dim {dim}, length {x.shape[dim]}) must split into {len(order)} equal chunks "
                         f"for the {layout} layout over {world} devices")
    chunks = jnp.split(x, len(order), axis=dim)
    return jnp.concatenate([chunks[c] for c in order], axis=dim)


def unshard_sequence(x, world, layout="zigzag", dim=1):
    """The inverse of shard_sequence."""
    order = _ring.chunk_order(world, layout)
    held = jnp.split(x, len(order), axis=dim)
    return jnp.concatenate([held[order.index(c)] for c in range(len(order))], axis=dim)


def ring_flash_attn(q, k, v, axis_name, softmax_scale=None, causal=False, softcap=0.0, layout="zigzag",
                    window_size=(-1, -1)):
    """flash_attn over a sequence sharded along mesh axis `axis_name`, called inside jax.shard_map:
    q (batch, seqlen_local, nheads, headdim), k and v (batch, seqlen_local, nheads_k, headdim) are
    this device's slices (`layout`, see shard_sequence); returns its slice of out. GQA, softcap and
    window_size (over the whole sequence's positions) compose; ALiBi is not taken (the kernels have
    no global key positions yet)."""
    checked = _ring.check_arguments(q, k, v, softmax_scale, causal, softcap, layout, window_size)
    return _ring_attention(q, k, v, _Settings(axis_name, layout, *checked))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Settings:  # the mesh axis, the layout and _ring.Settings' fields
    axis: object
    layout: str
    scale: float
    causal: bool
    softcap: float
    window_size: tuple


def _accumulator(q):
    return jnp.promote_types(q.dtype, jnp.float32)


def _each_step(settings, seqlen, compute, rotate, state):
    """For every step of the ring: state = compute(pieces, state), then rotate(step, state). Where
    the pieces depend on the rank, compute runs under jax.lax.switch between the ranks' distinct
    piece lists (two under a causal mask alone); the transfers stay outside it, the same on every
    device."""
    world, rank = jax.lax.axis_size(settings.axis), jax.lax.axis_index(settings.axis)
    for step in range(world):
        lists = [tuple(_ring.ring_steps(r, (r - step) % world, world, settings.causal, settings.layout, seqlen,
                                        settings.window_size)) for r in range(world)]
        distinct = list(dict.fromkeys(lists))
        if len(distinct) == 1:
            state = compute(distinct[0], state)
        else:
            branch = jnp.asarray([distinct.index(pieces) for pieces in lists])[rank]
            state = jax.lax.switch(branch, [functools.partial(compute, pieces) for pieces in distinct], state)
        state = rotate(step, state)
    return state


def _rotate(tensors, axis, world):
    return tuple(jax.lax.ppermute(t, axis, [(i, (i + 1) % world) for i in range(world)]) for t in tensors)


def _forward(q, k, v, settings):
    world = jax.lax.axis_size(settings.axis)
    acc = _accumulator(q)
    batch, seqlen, nheads, _ = q.shape

    def compute(pieces, state):
        out, lse, k_, v_ = state
        for piece in pieces:
            rows, keys = slice(piece.q0, piece.q1), slice(piece.k0, piece.k1)
            part, part_lse = forward_with_lse(q[:, rows], k_[:, keys], v_[:, keys], settings.scale, piece.causal,
                                              softcap=settings.softcap, window_size=piece.window_size)
            out, lse = _merge(out, lse, part.astype(acc), part_lse.astype(acc), piece.q0)
        return out, lse, k_, v_

    def rotate(step, state):
        out, lse, k_, v_ = state
        return (out, lse, *_rotate((k_, v_), settings.axis, world)) if step + 1 < world else state
    state = (_varying_like(jnp.zeros(q.shape, acc), q),
             _varying_like(jnp.full((batch, nheads, seqlen), -jnp.inf, acc), q), k, v)
    out, lse, _, _ = _each_step(settings, seqlen, compute, rotate, state)
    return out.astype(q.dtype), lse


def _merge(out, lse, part, part_lse, q0):
    """out (batch, rows, nheads, headdim) and lse (batch, nheads, rows) with a piece's rows from q0 on
    added by log-sum-exp; rows still without a key keep out 0 and lse -inf."""
    rows = slice(q0, q0 + part.shape[1])
    old_lse = lse[:, :, rows]
    new_lse = jnp.logaddexp(old_lse, part_lse)
    base = jnp.where(jnp.isneginf(new_lse), 0.0, new_lse)
    weight = lambda x: jnp.exp(x - base).transpose(0, 2, 1)[..., None]  # noqa: E731
    out = out.at[:, rows].set(out[:, rows] * weight(old_lse) + part * weight(part_lse))
    return out, lse.at[:, :, rows].set(new_lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring_attention(q, k, v, settings):
    return _forward(q, k, v, settings)[0]


def _ring_fwd(q, k, v, settings):
    out, lse = _forward(q, k, v, settings)
    return out, (q, k, v, out, lse)


def _ring_bwd(settings, residuals, dout):
    q, k, v, out, lse = residuals
    world = jax.lax.axis_size(settings.axis)
    acc = _accumulator(q)

    def compute(pieces, state):
        dq, dk, dv, k_, v_ = state
        for piece in pieces:
            rows, keys = slice(piece.q0, piece.q1), slice(piece.k0, piece.k1)
            grads = backward_with_stats(dout[:, rows], q[:, rows], k_[:, keys], v_[:, keys], out[:, rows],
                                        lse[:, :, rows], settings.scale, piece.causal, softcap=settings.softcap,
                                        window_size=piece.window_size)
            dq = dq.at[:, rows].add(grads[0].astype(acc))
            dk = dk.at[:, keys].add(grads[1].astype(acc))
            dv = dv.at[:, keys].add(grads[2].astype(acc))
        return dq, dk, dv, k_, v_

    def rotate(step, state):  # dK/dV go one step further than K/V: home after the last
        dq, dk, dv, k_, v_ = state
        if step + 1 < world:
            k_, v_ = _rotate((k_, v_), settings.axis, world)
        return (dq, *_rotate((dk, dv), settings.axis, world), k_, v_)
    state = (*(_varying_like(jnp.zeros(x.shape, acc), q) for x in (q, k, v)), k, v)
    dq, dk, dv, _, _ = _each_step(settings, q.shape[1], compute, rotate, state)
    return tuple(_varying_like(g.astype(x.dtype), x) for g, x in ((dq, q), (dk, k), (dv, v)))


def _varying_like(x, primal):
    """x typed as varying over the manual axes `primal` varies over: shard_map checks that a
    custom_vjp's cotangents have their primals' types."""
    return varying(x, varying_axes(primal))


_ring_attention.defvjp(_ring_fwd, _ring_bwd)
