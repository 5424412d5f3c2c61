"""Ring attention (context parallelism) over a torch.distributed process group: each rank holds a
slice of the sequence's q, k and v; the K/V slices travel around the ring, and each rank's partial
outputs merge by their log-sum-exp. Forward and backward give attention over the whole sequence.

The sequence's layouts over the ranks ("zigzag", "contiguous") and each step's pieces are
cupyflash/_ring.py's; shard_sequence and unshard_sequence convert a whole sequence. Each step runs
this rank's q against the K/V slice it holds (flash_attn_func, or its backward with the final out
and lse, which makes each piece's gradients exact) while the slice moves on to the next rank by
non-blocking sends and receives; the backward sends each slice's dK/dV accumulator
along with it, one step further, back to its owner. CUDA tensors run the kernels, CPU tensors the
NumPy path (the tests run the ring over gloo on the CPU).
"""

import torch
import torch.distributed as dist

from . import api
from ._ring import check_arguments, chunk_order, ring_steps
from .torch import _from_core, _to_core


def _chunks(x, world, layout, dim):
    """(x's chunks along dim, the order the ranks hold them in: _ring.chunk_order)."""
    order = chunk_order(world, layout)
    if x.shape[dim] % len(order):
        raise ValueError(f"the sequence (dim {dim}, length {x.shape[dim]}) must split into {len(order)} equal chunks "
                         f"for the {layout} layout over {world} ranks")
    return x.chunk(len(order), dim), order


def shard_sequence(x, group=None, layout="zigzag", dim=1):
    """This rank's slice of a whole sequence `x` (the same on every rank) in `layout`."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    chunks, order = _chunks(x, world, layout, dim)
    per_rank = len(order) // world
    return torch.cat([chunks[c] for c in order[rank * per_rank:(rank + 1) * per_rank]], dim)


def unshard_sequence(x, group=None, layout="zigzag", dim=1):
    """The whole sequence from every rank's slice `x` in `layout` (an all-gather)."""
    world = dist.get_world_size(group)
    order = chunk_order(world, layout)
    slices = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(slices, x.contiguous(), group=group)
    held = [chunk for s in slices for chunk in s.chunk(len(order) // world, dim)]
    return torch.cat([held[order.index(c)] for c in range(len(order))], dim)


def ring_flash_attn_func(q, k, v, softmax_scale=None, causal=False, softcap=0.0, group=None, layout="zigzag",
                         window_size=(-1, -1), alibi_slopes=None):
    """flash_attn_func over a sequence sharded across the ranks of `group` (`layout`: see the module).
    q (batch, seqlen_local, nheads, headdim), k and v (batch, seqlen_local, nheads_k, headdim) are
    this rank's slices; returns this rank's slice of out. Differentiable in q, k and v. softcap and
    window_size (over the whole sequence's positions; steps whose keys lie outside every row's window
    compute nothing) compose; alibi_slopes needs the keys' global positions, which the kernels do
    not take yet."""
    for name, value in (("q", q), ("k", k), ("v", v)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if alibi_slopes is not None:
        raise NotImplementedError("ring_flash_attn_func does not take alibi_slopes yet (across ranks it needs the "
                                  "keys' global positions, which the kernels do not take): pass alibi_slopes=None")
    settings = check_arguments(q, k, v, softmax_scale, causal, softcap, layout, window_size)
    return _Ring.apply(q, k, v, settings, group, layout)


def _attend(q, k, v, piece, settings):
    out, lse = api.flash_attn_func(_to_core(q), _to_core(k), _to_core(v), settings.scale, piece.causal,
                                   return_lse=True, softcap=settings.softcap, window_size=piece.window_size)
    return _from_core(out), _from_core(lse)


def _piece_backward(dout, q, k, v, out, lse, piece, settings):
    """A piece's share of the gradients, in the accumulators' dtype: flash_attn_backward takes its
    probabilities from the whole forward's lse and its row terms from its out."""
    grads = api.flash_attn_backward(*(_to_core(t) for t in (dout, q, k, v, out, lse.contiguous())), settings.scale,
                                    piece.causal, softcap=settings.softcap, window_size=piece.window_size)
    return tuple(_from_core(g).to(_accumulator(q)) for g in grads)


def _pieces(rank, step, world, settings, layout, seqlen_local):
    return ring_steps(rank, (rank - step) % world, world, settings.causal, layout, seqlen_local, settings.window_size)


def _rotate(tensors, group):
    """Sends `tensors` to the next rank and receives the previous rank's, without waiting: (the
    received tensors, a function that waits for the transfers)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    to, frm = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        to, frm = dist.get_global_rank(group, to), dist.get_global_rank(group, frm)
    received = [torch.empty_like(t) for t in tensors]
    requests = [dist.isend(t.contiguous(), to, group=group) for t in tensors]
    requests += [dist.irecv(r, frm, group=group) for r in received]
    return received, lambda: [request.wait() for request in requests]


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, settings, group, layout):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        batch, seqlen, nheads, _ = q.shape
        out = torch.zeros(q.shape, dtype=_accumulator(q), device=q.device)
        lse = torch.full((batch, nheads, seqlen), -torch.inf, dtype=_accumulator(q), device=q.device)
        kv = (k, v)
        for step in range(world):
            wait = None
            if step + 1 < world:
                received, wait = _rotate(kv, group)
            for piece in _pieces(rank, step, world, settings, layout, seqlen):
                part, part_lse = _attend(q[:, piece.q0:piece.q1], kv[0][:, piece.k0:piece.k1],
                                         kv[1][:, piece.k0:piece.k1], piece, settings)
                _merge(out, lse, part.to(_accumulator(q)), part_lse.to(_accumulator(q)), piece.q0)
            if wait is not None:
                wait()
                kv = received
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = settings, group, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        settings, group, layout = ctx.settings
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=_accumulator(q), device=q.device)
        kv = (k, v)
        dkv = (torch.zeros(k.shape, dtype=_accumulator(q), device=k.device),
               torch.zeros(v.shape, dtype=_accumulator(q), device=v.device))
        for step in range(world):
            wait = None
            if step + 1 < world:
                received, wait = _rotate(kv, group)
            for piece in _pieces(rank, step, world, settings, layout, q.shape[1]):
                rows, keys = slice(piece.q0, piece.q1), slice(piece.k0, piece.k1)
                dq_piece, dk_piece, dv_piece = _piece_backward(
                    dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows], lse[:, :, rows],
                    piece, settings)
                dq[:, rows] += dq_piece
                dkv[0][:, keys] += dk_piece
                dkv[1][:, keys] += dv_piece
            # The accumulators go one step further than the slices: after the last step they
            # reach the rank that owns them.
            dkv, wait_dkv = _rotate(dkv, group)
            if wait is not None:
                wait()
                kv = received
            wait_dkv()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _accumulator(q):
    """The dtype partial results merge and gradients add in: fp32, or q's if wider (the NumPy path's fp64)."""
    return torch.promote_types(q.dtype, torch.float32)


def _merge(out, lse, part, part_lse, q0):
    """Adds a piece's rows (from q0 on) to out (batch, rows, nheads, headdim) and lse (batch, nheads,
    rows) in place, by log-sum-exp; rows still without a key keep out 0 and lse -inf."""
    rows = slice(q0, q0 + part.shape[1])
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, part_lse)
    base = torch.where(torch.isneginf(new_lse), 0.0, new_lse)
    weight = lambda x: torch.exp(x - base).transpose(1, 2).unsqueeze(-1)  # noqa: E731
    out[:, rows] = out[:, rows] * weight(old_lse) + part * weight(part_lse)
    lse[:, :, rows] = new_lse
