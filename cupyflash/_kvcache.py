"""flash_attn_with_kvcache on the GPU, composed of array operations and the varlen forward kernel:
correct and graph-capturable (nothing is read on the host), not yet fast (the split-KV decode
kernels will replace it).

On the caller's stream, in CuPy (torch tensors are viewed through DLPack, zero copy, so the cache
writes land in them):
  1. the new keys (rotated, in float32, then rounded to the cache's dtype) and values are written
     into the caches at cache_seqlens, and q is rotated;
  2. each sequence's keys, positions cache_leftpad .. cache_seqlens + seqlen_new - 1, are gathered
     into packed arrays (batch x capacity rows, the unused ones left out of cu_seqlens_k);
  3. the varlen forward runs on them under no_host_sync, every sequence with its own masks, ALiBi
     and bottom-right alignment.
The packed copy reads and writes the whole cache once per call: a decode step costs about three
times its cache read.
"""

import numpy

from . import _arrays, api, validate

_captured = []  # the allocations of calls made under graph capture (_captured_call)


def attention(call, cache, q, alibi_slopes, return_softmax_lse):
    """(out, lse) of a checked GPU call (validate.check_kvcache), in the caller's kind of array."""
    import cupy
    caller = call.caller
    view = caller.launchable if caller.kind != "torch" else cupy.from_dlpack
    with cupy.cuda.Device(caller.device_id), _arrays.external_stream(caller.stream_pointer(), caller.device_id):
        stream = cupy.cuda.get_current_stream()
        arrays = {name: None if value is None else view(value)
                  for name, value in dict(q=q, k_cache=cache.k_cache, v_cache=cache.v_cache, k=cache.k, v=cache.v,
                                          rotary_cos=cache.rotary_cos, rotary_sin=cache.rotary_sin,
                                          cache_seqlens=cache.cache_seqlens, cache_batch_idx=cache.cache_batch_idx,
                                          cache_leftpad=cache.cache_leftpad, block_table=cache.block_table,
                                          alibi_slopes=alibi_slopes).items()}
        if stream.is_capturing():
            out, lse = _captured_call(lambda: compose(call, cache, arrays, cupy))
        else:
            out, lse = compose(call, cache, arrays, cupy)
    if caller.kind == "torch":
        import torch
        out, lse = torch.from_dlpack(out), torch.from_dlpack(lse)
    elif caller.kind != "cupy":
        out, lse = caller.give_back(out), caller.give_back(lse)
    return (out, lse) if return_softmax_lse else out


def compose(call, cache, a, xp):
    """(out, lse) of a checked call on arrays `a` by name (those of array module xp: CuPy here, NumPy
    in the tests, which check the index arithmetic against the reference without a GPU)."""
    batch, seqlen_q, nheads, headdim = a["q"].shape
    k_cache, v_cache = a["k_cache"], a["v_cache"]
    nheads_k, capacity, new = k_cache.shape[2], cache.capacity, cache.seqlen_new
    page = k_cache.shape[1]
    entries = xp.arange(batch, dtype=xp.int32)
    if a["cache_seqlens"] is not None:
        lengths = a["cache_seqlens"].astype(xp.int32)
    else:
        full = capacity - new if cache.seqlens_int is None else cache.seqlens_int
        lengths = xp.full(batch, full, xp.int32)
    rows = entries if a["cache_batch_idx"] is None else a["cache_batch_idx"]

    def at(positions):  # the cache index of each sequence's positions (batch, n), clamped into the cache
        positions = xp.minimum(positions, capacity - 1)
        if cache.paged:
            return a["block_table"][entries[:, None], positions // page], positions % page
        return rows[:, None], positions

    q = a["q"]
    if new:
        positions = lengths[:, None] + xp.arange(new, dtype=xp.int32)[None]
        k_new = a["k"]
        if a["rotary_cos"] is not None:
            k_new = _rotate(k_new, a["rotary_cos"], a["rotary_sin"], positions, cache.rotary_interleaved, xp)
            offsets = xp.arange(seqlen_q, dtype=xp.int32) if call.local else xp.zeros(seqlen_q, xp.int32)
            q = _rotate(q, a["rotary_cos"], a["rotary_sin"], lengths[:, None] + offsets[None],
                        cache.rotary_interleaved, xp).astype(q.dtype)
        where = at(positions)
        k_cache[where] = k_new.astype(k_cache.dtype)
        v_cache[where] = a["v"]

    starts = xp.zeros(batch, xp.int32) if a["cache_leftpad"] is None else a["cache_leftpad"]
    seqlens_k = xp.maximum(lengths + new - starts, 0).astype(xp.int32)
    cu_seqlens_k = xp.zeros(batch + 1, xp.int32)
    cu_seqlens_k[1:] = xp.cumsum(seqlens_k)
    j = xp.arange(capacity, dtype=xp.int32)[None]
    dummy = batch * capacity  # the row that takes every unused position
    destination = xp.where(j < seqlens_k[:, None], cu_seqlens_k[:-1, None] + j, dummy).ravel()
    where = at(starts[:, None] + j)
    packed = []
    for source in (k_cache, v_cache):
        rows_out = xp.empty((dummy + 1, nheads_k, headdim), source.dtype)
        rows_out[destination] = source[where].reshape(-1, nheads_k, headdim)
        packed.append(rows_out)
    if xp is numpy:  # the NumPy path checks the packing on the host: exactly the packed rows
        packed = [rows_out[:int(cu_seqlens_k[-1])] for rows_out in packed]
    cu_seqlens_q = xp.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=xp.int32)
    q_packed = xp.ascontiguousarray(q).reshape(batch * seqlen_q, nheads, headdim)
    with validate.no_host_sync():
        out, lse = api.flash_attn_varlen_func(
            q_packed, *packed, cu_seqlens_q, cu_seqlens_k, seqlen_q, capacity, call.scale, call.causal,
            window_size=call.checked["window_size"],  # causal folded in: the varlen call folds it again, the same
            softcap=call.checked["softcap"], alibi_slopes=a["alibi_slopes"],
            return_lse=True)
    out = out.reshape(batch, seqlen_q, nheads, headdim)
    return out, xp.ascontiguousarray(lse.reshape(nheads, batch, seqlen_q).transpose(1, 0, 2))


def _captured_call(compose):
    """compose() under graph capture, every allocation it makes kept for the process's life: the
    graph's replays read and write them, and CuPy's pool would hand them to later arrays."""
    import cupy
    pool, kept = cupy.get_default_memory_pool(), []

    def malloc(size):
        memory = pool.malloc(size)
        kept.append(memory)
        return memory
    with cupy.cuda.using_allocator(malloc):
        result = compose()
    _captured.append(kept)
    return result


def _rotate(x, cos, sin, positions, interleaved, xp):
    """x (batch, n, heads, headdim) rotated in float32 at positions (batch, n) (see
    cupyflash.reference.rotate)."""
    x = x.astype(xp.float32)
    half = cos.shape[1]
    c = cos.astype(xp.float32)[positions][:, :, None, :]
    s = sin.astype(xp.float32)[positions][:, :, None, :]
    first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else \
        (slice(0, half), slice(half, 2 * half))
    a, b = x[..., first].copy(), x[..., second].copy()
    x[..., first], x[..., second] = a * c - b * s, a * s + b * c
    return x
