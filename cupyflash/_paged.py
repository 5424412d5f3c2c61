"""A varlen call's keys and values gathered from a paged cache on the device, with no host read of
the lengths or the block table, so that the call runs under no_host_sync, in a graph capture and
under jax.jit: api.paged_rows's rule (sequence b's key t is in block block_table[b, t // page_size]
at row t % page_size) in the NumPy calls that CuPy, jax.numpy and (through `TorchCalls`) torch share.

The packed rows are as many as the block table holds (batch x pages x page_size), a count known from
the shapes alone, as jax.jit and torch.compile need. The rows past the last sequence's keys form
extra sequences of keys alone, each at most max_seqlen_k long, so that the packing's checks hold;
with no queries they change no result (ALiBi slopes per sequence get zero rows for them). Indices
outside the table or the cache are clamped: callers check the values where they may read them.
"""


def packed_from_pages(xp, k_cache, v_cache, varlen, block_table, alibi_slopes):
    """(k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes) of a varlen call (validate.Varlen, its shapes
    checked) over a paged cache, built with the array module `xp` on the arrays' device."""
    cu_q, cu_k, longest = varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.max_seqlen_k
    (batch, pages), (blocks, page) = block_table.shape, k_cache.shape[:2]
    rows = batch * pages * page if longest else 0
    position = xp.arange(rows, dtype=xp.int32)
    sequence = xp.clip(xp.searchsorted(cu_k, position, side="right") - 1, 0, max(batch - 1, 0))
    offset = position - cu_k[sequence]  # in its sequence
    held = position < cu_k[-1]
    entry = xp.clip(block_table[sequence, xp.clip(offset // page, 0, pages - 1)], 0, blocks - 1)
    block, row = xp.where(held, entry, 0), xp.where(held, offset % page, 0)
    step = min(longest, rows)  # an extra sequence's keys (int32 sums stay below 2 x rows)
    extra = -(-rows // step) if rows else 0
    ends = xp.minimum(cu_k[-1] + step * xp.arange(1, extra + 1, dtype=xp.int32), rows)
    if len(getattr(alibi_slopes, "shape", ())) == 2 and alibi_slopes.shape[0] == batch:
        alibi_slopes = xp.concatenate([alibi_slopes, xp.zeros((extra, alibi_slopes.shape[1]), alibi_slopes.dtype)])
    return (k_cache[block, row], v_cache[block, row], xp.concatenate([cu_q, xp.broadcast_to(cu_q[-1:], (extra,))]),
            xp.concatenate([cu_k, ends]), alibi_slopes)


class TorchCalls:
    """The calls packed_from_pages makes, in torch's spelling, on one device (torch's arange takes
    the device; its own searchsorted, clip and where differ only in name or argument)."""

    def __init__(self, device):
        import torch
        self.torch, self.device, self.int32 = torch, device, torch.int32

    def arange(self, *bounds, dtype):
        return self.torch.arange(*bounds, dtype=dtype, device=self.device)

    def searchsorted(self, a, v, side):
        return self.torch.searchsorted(a, v, side=side)

    def clip(self, x, low, high):
        return self.torch.clamp(x, low, high)

    def where(self, condition, x, y):
        return self.torch.where(condition, x, y)

    def minimum(self, x, high):
        return self.torch.clamp(x, max=high)

    def zeros(self, shape, dtype):
        return self.torch.zeros(shape, dtype=dtype, device=self.device)

    def concatenate(self, arrays):
        return self.torch.cat(arrays)

    def broadcast_to(self, x, shape):
        return x.expand(shape)
