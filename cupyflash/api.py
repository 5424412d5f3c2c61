"""The public functions: checks, then the GPU kernels or, for NumPy arrays, the float64 reference.

Names, argument order and layout follow flash_attn's `flash_attn_func`: q is
(batch, seqlen_q, nheads, headdim), k and v are (batch, seqlen_k, nheads_k, headdim).
The options are keyword arguments declared in options.py; each function's signature and
docstring list those it takes.
"""

from . import _kvcache, _paged, _plan, options, reference, validate
from .validate import Varlen


def _takes_options(pass_, varlen=False):
    """Gives a public function the keyword options of its pass (options.for_call) in its signature
    and docstring; the function takes them as **given and passes them to _call."""
    def decorate(function):
        options.add_to_signature(function, options.for_call(pass_, varlen))
        function.__doc__ += options.doc(pass_, varlen)
        return function
    return decorate


@_takes_options("fwd")
def flash_attn_func(q, k, v, softmax_scale=None, causal=False, *, return_lse=False, **given):
    """Exact attention softmax(q k^T * softmax_scale) v, without materialising the score matrix.

    q is (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim).
    Returns out, shaped like q, or (out, lse) when return_lse is true; lse is
    (batch, nheads, seqlen_q) float32 (float64 for float64 NumPy inputs), the natural-log sum of
    exp(scores) per query row. A row that sees no key (causal with seqlen_q > seqlen_k, or a
    window past every key) gets out = 0 and lse = -inf. Causal masking is aligned bottom-right:
    query i sees key j iff j <= i + seqlen_k - seqlen_q.
    """
    result = _call("fwd", dict(q=q, k=k, v=v), softmax_scale, causal, given, "flash_attn_func",
                   dropped=() if return_lse else ("lse",))
    return result if return_lse else result[0]


@_takes_options("bwd")
def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False, *, return_dbias=False, **given):
    """Gradients (dq, dk, dv) of flash_attn_func, shaped like q, k, v; the options must be the forward's.

    dout is the gradient of out; out and lse are what the forward returned (return_lse=True).
    return_dbias=True also returns the gradient of attn_bias, in attn_bias's shape and dtype (None
    without attn_bias).
    """
    return _call("bwd", dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse), softmax_scale, causal, given,
                 "flash_attn_backward", return_dbias=validate.check_flag("return_dbias", return_dbias))


@_takes_options("fwd", varlen=True)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, *, return_lse=False, block_table=None, **given):
    """flash_attn_func over a batch of sequences of different lengths, packed without padding.

    q is (total_q, nheads, headdim) and k, v (total_k, nheads_k, headdim); sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v
    (int32 arrays of length batch + 1 on q's device; empty sequences are allowed). max_seqlen_* are
    the longest lengths (ints). lse is (nheads, total_q). Masks and ALiBi are per sequence.
    The cu_seqlens are checked on the host, which waits for them to be computed (torch tensors
    again only after torch writes them).
    With block_table (int32 (batch, pages per sequence)), k and v are a paged cache (num_blocks,
    page_size, nheads_k, headdim), page_size a multiple of 16: sequence b's key t is in block
    block_table[b, t // page_size] at row t % page_size, for t < cu_seqlens_k[b + 1] -
    cu_seqlens_k[b] (prefill from a paged cache): the keys and values are gathered into packed
    arrays first (a copy; on a GPU with no host read, so under no_host_sync too: _from_pages).
    """
    if block_table is not None:
        k, v, cu_seqlens_q, cu_seqlens_k, given = _from_pages(
            q, k, v, Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), block_table, given)
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    result = _call("fwd", dict(q=q, k=k, v=v), softmax_scale, causal, given, "flash_attn_varlen_func", varlen,
                   dropped=() if return_lse else ("lse",))
    return result if return_lse else result[0]


def paged_rows(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table):
    """(the Caller, blocks, rows) of a varlen call over a paged cache, after its checks: NumPy
    arrays giving the cache block and row of each packed key (read on the host with the lengths)."""
    caller, lengths, table = validate.check_paged_varlen(q, k_cache, v_cache, Varlen(cu_seqlens_q, cu_seqlens_k, 0, 0),
                                                         block_table)
    return (caller, *_rows_of_pages(lengths, table, k_cache.shape[1]))


def _rows_of_pages(lengths, table, page):
    """(blocks, rows): the cache block and row of each packed key, from the key lengths and the block
    table on the host."""
    import numpy
    sequence = numpy.repeat(numpy.arange(len(lengths)), lengths)  # of each packed key
    position = numpy.arange(len(sequence)) - numpy.repeat(numpy.cumsum(lengths) - lengths, lengths)  # in its sequence
    return table[sequence, position // page].astype(numpy.int64), position % page


def _from_pages(q, k_cache, v_cache, varlen, block_table, given):
    """(k, v, cu_seqlens_q, cu_seqlens_k, given) of a varlen call over a paged cache, packed as the
    varlen kernels take them: NumPy arrays exactly, on the host (_rows_of_pages); GPU arrays on their
    device with no host read (_paged.packed_from_pages, extra key-only sequences after the last), so
    under no_host_sync and in a graph capture, their values checked on the host everywhere else."""
    slopes = given.get("alibi_slopes")
    caller, lengths, table = validate.check_paged_varlen(q, k_cache, v_cache, varlen, block_table, slopes)
    if caller.kind == "numpy":
        blocks, rows = _rows_of_pages(lengths, table, k_cache.shape[1])
        return k_cache[blocks, rows], v_cache[blocks, rows], varlen.cu_seqlens_q, varlen.cu_seqlens_k, given
    if caller.kind == "torch":
        packed = _paged.packed_from_pages(_paged.TorchCalls(k_cache.device), k_cache, v_cache, varlen, block_table,
                                          slopes)
    else:
        import cupy
        view = caller.launchable
        with caller.device():
            packed = _paged.packed_from_pages(
                cupy, view(k_cache), view(v_cache),
                Varlen(view(varlen.cu_seqlens_q), view(varlen.cu_seqlens_k), varlen.max_seqlen_q, varlen.max_seqlen_k),
                view(block_table), None if slopes is None else view(slopes))
        packed = [None if x is None else caller.give_back(x) for x in packed]
    *packed, slopes = packed
    return (*packed, given if slopes is None else dict(given, alibi_slopes=slopes))


@_takes_options("bwd", varlen=True)
def flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, **given):
    """Gradients (dq, dk, dv) of flash_attn_varlen_func, packed like q, k, v."""
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _call("bwd", dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse), softmax_scale, causal, given,
                 "flash_attn_varlen_backward", varlen)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q over a KV cache, after appending k and v to it in place: flash_attn's
    flash_attn_with_kvcache, for incremental decoding and chunked prefill.

    q is (batch, seqlen_q, nheads, headdim). k_cache and v_cache are (batch_cache, seqlen_cache,
    nheads_k, headdim), or a paged cache (num_blocks, page_size, nheads_k, headdim) with
    block_table (batch, pages per sequence) int32: sequence b's position t is in block
    block_table[b, t // page_size] at row t % page_size (page_size a multiple of 16).
    cache_seqlens (an int or an int32 (batch,) array; None: the cache is full) gives each
    sequence's cached length; k and v (batch, seqlen_new, nheads_k, headdim), if given, are written
    at positions cache_seqlens .. cache_seqlens + seqlen_new - 1, in place, and attended to.
    rotary_cos and rotary_sin (seqlen_ro, rotary_dim / 2), with k and v, rotate the first
    rotary_dim dims of the new keys by the angles of their positions, and those of q by the angles
    of positions cache_seqlens + i when causal or local, else all at cache_seqlens;
    rotary_interleaved pairs dims (2j, 2j + 1) (GPT-J), else (j, j + rotary_dim / 2) (GPT-NeoX).
    cache_batch_idx (int32 (batch,)) picks the cache row of each batch entry (dense caches);
    cache_leftpad (int32 (batch,)) where each sequence starts in its row. Sequence b attends to
    positions cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1, which masks (causal aligned
    bottom-right), the window and ALiBi see as keys 0 .. seqlen_k - 1. num_splits is a hint for
    the GPU kernels (0 picks). Returns out like q, and lse (batch, nheads, seqlen_q) float32 with
    return_softmax_lse. Options as flash_attn_func's: window_size, softcap, alibi_slopes.

    NumPy arrays run the float64 reference; GPU arrays the KV-cache kernels (append and rotary,
    split-KV attention with the query heads of a KV group packed together, the splits' merge:
    cupyflash/_kvcache.py), graph-capturable; the caches are updated in place either way. The
    lengths, indices and block table are checked on the host, which waits for them, unless under
    validate.no_host_sync() or a graph capture (then the kernels clamp them into the caches).
    """
    # Under no_host_sync a repeated signature (every array's layout, every other argument's value)
    # goes straight to its plan: nothing validation checks can differ from the call that made it.
    arrays = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
              block_table, alibi_slopes)
    scalars = (softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits, return_softmax_lse,
               None if hasattr(cache_seqlens, "shape") else cache_seqlens)
    key = _kvcache.signature(arrays, scalars)
    if validate.host_sync_off():
        result = _kvcache.run_resolved(key, arrays, return_softmax_lse)
        if result is not None:
            return result
    given = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    call, cache = validate.check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                         cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, given,
                                         rotary_interleaved, num_splits)
    return_softmax_lse = validate.check_flag("return_softmax_lse", return_softmax_lse)
    if call.caller.kind != "numpy":
        return _kvcache.attention(call, cache, arrays, return_softmax_lse, key)
    import numpy
    seqlens = cache.cache_seqlens if cache.seqlens_int is None else numpy.full(call.shape.batch, cache.seqlens_int)
    out, lse = reference.kvcache_attention(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx, cache_leftpad, block_table,
        call.scale, call.causal, window_size=window_size, softcap=call.checked["softcap"],
        rotary_interleaved=cache.rotary_interleaved, alibi_slopes=call.checked["alibi_slopes"])
    out = out.astype(q.dtype)
    return (out, lse.astype(validate.lse_dtype(call.dtype))) if return_softmax_lse else out


# Packed forms: views into one array, no copies (JAX has no views; there indexing copies).

def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, **given):
    """flash_attn_func with q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]; qkv is (batch, seqlen, 3, nheads, headdim)."""
    validate.check_packed("qkv", qkv, 5, 3)
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale, causal, **given)


def flash_attn_kvpacked_func(q, kv, softmax_scale=None, causal=False, **given):
    """flash_attn_func with k, v = kv[:, :, 0], kv[:, :, 1]; kv is (batch, seqlen_k, 2, nheads_k, headdim)."""
    validate.check_packed("kv", kv, 5, 2)
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], softmax_scale, causal, **given)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, softmax_scale=None, causal=False, **given):
    """flash_attn_varlen_func with q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]; qkv is (total, 3, nheads, headdim)."""
    validate.check_packed("qkv", qkv, 4, 3)
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  softmax_scale, causal, **given)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    softmax_scale=None, causal=False, **given):
    """flash_attn_varlen_func with k, v = kv[:, 0], kv[:, 1]; kv is (total_k, 2, nheads_k, headdim)."""
    validate.check_packed("kv", kv, 4, 2)
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal, **given)


# Per (pass, varlen): the defaults of the options a function takes, and which of them are arrays
# (worked out once: every call looks them up).
_TAKEN = {(pass_, varlen): ({o.name: o.default for o in options.for_call(pass_, varlen)},
                            tuple(o.name for o in options.for_call(pass_, varlen) if o.kind == "array"))
          for pass_ in ("fwd", "bwd") for varlen in (False, True)}


def _gather(pass_, arrays, given, function, varlen):
    """(every option of the call: `given` with the defaults filled in, `given` itself: the options
    as the plan key holds them, for which defaults add nothing); adds the call's other arrays
    (cu_seqlens, the options' arrays, a seed array) to `arrays`."""
    defaults, array_names = _TAKEN[pass_, varlen is not None]
    if varlen is not None:
        arrays.update(cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_k)
    if not given:
        return defaults, given
    for name in given:
        if name not in defaults:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    every = {**defaults, **given}
    for name in array_names:
        if every[name] is not None:
            arrays[name] = every[name]
    if options.is_seed_array(every.get("seed")):
        arrays["seed"] = every["seed"]  # read by the kernels on the device
    return every, given


def _lookup(pass_, arrays, softmax_scale, causal, given, function, varlen, return_dbias):
    """(every option of the call, its plan key, its cached plan or None) after _gather; a cached
    varlen plan's cu_seqlens are checked, since their values change from call to call."""
    given, as_given = _gather(pass_, arrays, given, function, varlen)
    key = _plan.plan_key(pass_, arrays, softmax_scale, causal, as_given, varlen, return_dbias)
    plan = _plan.cached(key)
    if plan is not None and varlen is not None:
        validate.check_varlen_values(varlen, arrays, plan.caller)
    return given, key, plan


def _call(pass_, arrays, softmax_scale, causal, given, function, varlen=None, return_dbias=False, into=None,
          dropped=()):
    """One public call: the cached plan of its signature if there is one, else checks and a new plan.
    `into` maps result names (out, lse; dq, dk, dv) to device addresses the kernels write instead of
    new arrays (JAX's result buffers); those results come back as the addresses. `dropped` names
    results the caller does not return, which a plan writes into a buffer of its own instead of a
    new array. A head dim that is not a multiple of 8 ignores both (its results are cut from
    padded ones)."""
    given, key, plan = _lookup(pass_, arrays, softmax_scale, causal, given, function, varlen, return_dbias)
    if plan is not None:
        result = plan.run(arrays, given.get("seed"), into, dropped=dropped)
        if result is not None:
            return result
    call = validate.check_call(pass_, arrays, softmax_scale, causal, given, varlen)
    if call.caller.kind == "numpy":
        return _reference(call, arrays, return_dbias)
    if call.shape.headdim % 8:
        return _padded_head_dim(call, arrays, given, return_dbias)
    plan, inputs = _plan.new_plan(call, arrays, key, return_dbias)
    return plan.run(inputs, call.checked.get("seed"), into, dropped=dropped)


def plan_of(pass_, arrays, softmax_scale, causal, given, function, varlen=None, return_dbias=False):
    """The launch plan of a GPU call (arguments as _call's, checked as _call checks them), for a
    caller that runs it again on other buffers of the same layout by their addresses:
    `plan.run(addresses by input name, None, into=..., stream=...)`, a dropout seed being an array
    among the inputs (cupyflash.jax's handlers keep it per custom call); None where no plan runs
    the call (a head dim that is not a multiple of 8, NumPy arrays)."""
    given, key, plan = _lookup(pass_, arrays, softmax_scale, causal, given, function, varlen, return_dbias)
    if plan is not None:
        return plan
    call = validate.check_call(pass_, arrays, softmax_scale, causal, given, varlen)
    if call.caller.kind == "numpy" or call.shape.headdim % 8:
        return None
    return _plan.new_plan(call, arrays, key, return_dbias)[0]


def _padded_head_dim(call, arrays, given, return_dbias):
    """A GPU call at a head dim that is not a multiple of 8 (the kernels copy rows in 16-byte
    chunks): q, k, v (and dout, out) zero-padded to the next multiple of 8, which leaves every
    score and the lse unchanged; the scale stays the caller's head dim's; results are cut back."""
    caller, headdim = call.caller, call.shape.headdim
    width = -(-headdim // 8) * 8
    padded = {name: caller.launchable(array) for name, array in arrays.items()}
    for name in ("q", "k", "v", "dout", "out"):
        if name in padded:
            wide = caller.zeros((*padded[name].shape[:-1], width), call.dtype)
            wide[..., :headdim] = padded[name]
            padded[name] = wide
    others = {name: padded.get(name, value) for name, value in given.items()}
    names = ("dout", "q", "k", "v", "out", "lse") if call.pass_ == "bwd" else ("q", "k", "v")
    args = [padded[name] for name in names]
    if call.varlen is not None:
        args += [padded["cu_seqlens_q"], padded["cu_seqlens_k"], call.varlen.max_seqlen_q, call.varlen.max_seqlen_k]
    if call.pass_ == "fwd":
        target = flash_attn_varlen_func if call.varlen is not None else flash_attn_func
        out, lse = target(*args, call.scale, call.causal, return_lse=True, **others)
        results = (_cut(out, headdim, caller), lse)
    else:
        if call.varlen is None:
            grads = flash_attn_backward(*args, call.scale, call.causal, return_dbias=return_dbias, **others)
        else:
            grads = flash_attn_varlen_backward(*args, call.scale, call.causal, **others)
        results = tuple(_cut(g, headdim, caller) for g in grads[:3]) + tuple(grads[3:])
    if caller.kind in ("torch", "cupy"):
        return results
    return tuple(None if r is None else caller.give_back(r) for r in results)


def _cut(array, headdim, caller):
    """The first `headdim` columns of a padded result, contiguous like every result."""
    array = array[..., :headdim]
    if caller.kind == "torch":
        return array.contiguous()
    import cupy
    return cupy.ascontiguousarray(array)


def _reference(call, arrays, return_dbias):
    """The NumPy path: the float64 reference, results in the inputs' dtypes (lse as validate.lse_dtype)."""
    import numpy
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    kwargs = {name: value for name, value in call.checked.items() if options.by_name(name).reference}
    varlen = call.varlen is not None
    cu = (arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]) if varlen else ()
    if call.pass_ == "fwd":
        forward = reference.attention_forward_varlen if varlen else reference.attention_forward
        out, lse = forward(q, k, v, *cu, call.scale, call.causal, **kwargs)
        return out.astype(q.dtype), lse.astype(numpy.dtype(validate.lse_dtype(call.dtype)))
    # The backward takes its probabilities from lse and its softmax row terms from out, as the kernels do.
    stats = dict(dout=arrays["dout"], out=arrays["out"], lse=arrays["lse"])
    if varlen:
        grads = reference.attention_backward_varlen(q=q, k=k, v=v, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1],
                                                    softmax_scale=call.scale, causal=call.causal, **stats, **kwargs)
    else:
        grads = reference.attention_backward(q=q, k=k, v=v, softmax_scale=call.scale, causal=call.causal,
                                             return_dbias=return_dbias, **stats, **kwargs)
    result = tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))
    if return_dbias:
        bias = call.checked.get(options.DIFFERENTIABLE)
        result += (None if grads[3] is None else grads[3].astype(bias.dtype),)
    return result
