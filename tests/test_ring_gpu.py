"""Ring attention's pieces on one GPU: every rank of a simulated ring runs its steps' pieces
(cupyflash/_ring.py) through the kernels, merges them by log-sum-exp and takes each piece's share of
the gradients, as cupyflash.torch.ring_flash_attn_func does over NCCL; gathered, out, lse and the
gradients follow the float64 reference under the 2x / 3x rule (cupyflash/_check.py). Windowed rings
run trimmed pieces with windows of their own, which this checks on the kernels.
"""

import numpy
import pytest

from cupyflash import _check
from cupyflash._check import Case
from cupyflash._ring import chunk_order, ring_steps

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_allocations")]


def _positions(rank, world, layout, seqlen):
    """Global positions of rank's slice, in its local order."""
    order = chunk_order(world, layout)
    per_rank, size = len(order) // world, seqlen // len(order)
    return numpy.concatenate([numpy.arange(c * size, (c + 1) * size)
                              for c in order[rank * per_rank:(rank + 1) * per_rank]])


def _merge(out, lse, part, part_lse, q0):
    import cupy
    rows = slice(q0, q0 + part.shape[1])
    old = lse[:, :, rows]
    new = cupy.logaddexp(old, part_lse)
    base = cupy.where(cupy.isneginf(new), 0.0, new)
    weight = lambda x: cupy.exp(x - base).transpose(0, 2, 1)[..., None]  # noqa: E731
    out[:, rows] = out[:, rows] * weight(old) + part.astype(cupy.float32) * weight(part_lse)
    lse[:, :, rows] = new


def _ring_on_one_gpu(case, arrays, world, layout):
    """(out, lse, (dq, dk, dv)) of the ring, gathered into the sequence's order (float64 NumPy)."""
    import cupy
    from cupyflash import flash_attn_backward, flash_attn_func
    q, k, v, dout = (arrays[name] for name in ("q", "k", "v", "dout"))
    batch, seqlen, nheads, _ = q.shape
    scale = case.headdim ** -0.5
    options = {name: value for name, value in case.options if name == "softcap"}
    window = dict(case.options).get("window_size", (-1, -1))
    local = [cupy.asarray(_positions(r, world, layout, seqlen)) for r in range(world)]
    sliced = lambda x, r: cupy.ascontiguousarray(x[:, local[r]])  # noqa: E731
    outs, lses = [], []
    for rank in range(world):
        out = cupy.zeros((batch, len(local[rank]), nheads, case.headdim), cupy.float32)
        lse = cupy.full((batch, nheads, len(local[rank])), -cupy.inf, cupy.float32)
        for step in range(world):
            source = (rank - step) % world
            for piece in ring_steps(rank, source, world, case.causal, layout, len(local[rank]), window):
                part, part_lse = flash_attn_func(
                    sliced(q, rank)[:, piece.q0:piece.q1], sliced(k, source)[:, piece.k0:piece.k1],
                    sliced(v, source)[:, piece.k0:piece.k1], scale, piece.causal, return_lse=True,
                    window_size=piece.window_size, **options)
                _merge(out, lse, part, part_lse, piece.q0)
        outs.append(out.astype(q.dtype))
        lses.append(lse)
    grads = [cupy.zeros(x.shape, cupy.float32) for x in (q, k, v)]
    for rank in range(world):
        for step in range(world):
            source = (rank - step) % world
            for piece in ring_steps(rank, source, world, case.causal, layout, len(local[rank]), window):
                rows, keys = slice(piece.q0, piece.q1), slice(piece.k0, piece.k1)
                dq, dk, dv = flash_attn_backward(
                    sliced(dout, rank)[:, rows], sliced(q, rank)[:, rows], sliced(k, source)[:, keys],
                    sliced(v, source)[:, keys], cupy.ascontiguousarray(outs[rank][:, rows]),
                    cupy.ascontiguousarray(lses[rank][:, :, rows]), scale, piece.causal,
                    window_size=piece.window_size, **options)
                grads[0][:, local[rank][rows]] += dq.astype(cupy.float32)
                grads[1][:, local[source][keys]] += dk.astype(cupy.float32)
                grads[2][:, local[source][keys]] += dv.astype(cupy.float32)
    order = cupy.argsort(cupy.concatenate(local))
    out = cupy.concatenate(outs, axis=1)[:, order]
    lse = cupy.concatenate(lses, axis=2)[:, :, order]
    as64 = lambda x: cupy.asnumpy(x).astype(numpy.float64)  # noqa: E731
    # The ring's gradients were summed in fp32; the kernels' own round to the dtype once at the end.
    return as64(out), as64(lse), [as64(g.astype(q.dtype)) for g in grads]


@pytest.mark.parametrize("world, layout, case", [
    (2, "zigzag", Case(96, 96, 128, "bfloat16", True, nheads=4, nheads_k=2)),
    (4, "zigzag", Case(256, 256, 64, "float16", True, nheads=4, nheads_k=1, window_size=(40, -1))),
    (3, "contiguous", Case(150, 150, 96, "bfloat16", False, nheads=2, nheads_k=2, window_size=(17, 30), softcap=2.0)),
    (4, "contiguous", Case(400, 400, 128, "bfloat16", True, nheads=2, nheads_k=2, window_size=(130, -1))),
], ids=["2-zigzag-causal", "4-zigzag-causal-window", "3-contiguous-window-softcap", "4-contiguous-causal-window"])
def test_the_ring_pieces_on_the_kernels_give_whole_sequence_attention(world, layout, case):
    inputs = _check.random_inputs(case, seed=world)
    arrays = _check.to_cupy_inputs(case, inputs)
    out, lse, grads = _ring_on_one_gpu(case, arrays, world, layout)
    result = _check.compare(case, inputs, out, lse, grads)
    assert result.ok, result.describe()
