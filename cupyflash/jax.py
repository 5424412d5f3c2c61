"""FlashAttention for JAX: `flash_attn` and `flash_attn_varlen` are jax.custom_vjp functions that
work eagerly, under jax.jit and under jax.grad.

Forward and backward are XLA custom calls through XLA's typed FFI (see _xla_ffi.py): inside a
jitted program XLA hands the handler its buffers and its CUDA stream, and the handler runs
cupyflash's kernels on that stream, writing into XLA's result buffers. On XLA's CPU backend the
same targets run the NumPy float64 reference, so jit, grad and the FFI plumbing are testable
without a GPU (and float32/float64 inputs work there).

    import jax, jax.numpy as jnp
    from cupyflash.jax import flash_attn
    out = jax.jit(flash_attn, static_argnames="causal")(q, k, v, causal=True)

Options (the core's, cupyflash.options): the pair, real and flag options are static (Python
values, part of the trace, sent as custom call attributes); the array options, dropout_seed and the
varlen cu_seqlens are operands (traced arrays). An array option with a gradient (attn_bias) gets
it where it is differentiated (custom_vjp's `perturbed`: the backward computes dbias only then),
the others a zero cotangent.

On the GPU nothing goes through the host and nothing is copied: the kernels read the seed and the
cu_seqlens where XLA wrote them (the core runs under validate.no_host_sync, so bad cu_seqlens give
wrong rows, never an access outside the buffers) and write out, lse, dq, dk and dv into XLA's
result buffers. Each custom call carries a signature attribute (a digest of its target,
attributes, shapes and dtypes); the CUDA handler keeps the core's launch plan per signature and
device, so a repeated call reads the buffers' addresses and the stream from the call frame and
launches. Two cases copy: a head dim that is not a multiple of 8 (the core pads it), and dbias,
which CuPy reduces from the kernels' float32 accumulator and copies into XLA's buffer.

CUDA graphs: each attention target has a graph twin (`_GRAPH`) whose handler declares XLA's
command-buffer trait, so that XLA may trace its calls into a command buffer (a CUDA graph, where
custom calls are enabled: --xla_gpu_enable_command_buffer with CUSTOM_CALL). A call traced for a
CUDA device goes to the twin wherever it runs without allocating or copying (the kernels'
dtypes, no padded head dim, no dbias): its launch is built while tracing, since XLA records a
command buffer by stream capture, which may come at the program's first execution (XLA 0.11 on
the H200 runs it eagerly once first, then replays without calling the handler); and the
backward's workspaces are extra uint8 results of the custom call, which the JAX side drops.

GPU memory: a graph twin's backward has its scratch from XLA, among the program's temporary
buffers. Elsewhere the backward's scratch (and the padded head dims' arrays) come from CuPy's
memory pool, beside XLA's own, with XLA's stream current in CuPy while the plan runs, so a freed
block is reused in stream order; a small scratch is kept per plan and stream (Plan._scratch), so
repeated calls allocate nothing. README's JAX section says what that means for XLA's preallocation.

jax.experimental.buffer_callback (JAX >= 0.7) hands a Python callback the same buffers without
the ctypes structures of _xla_ffi.py; bench/jax_handlers.py compares the two mechanisms' host time
per call, and bench/notes/jax-handlers.md says why the typed FFI stays.
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import numbers

import jax
import jax.numpy as jnp
import numpy

from . import _arrays, _config, _paged, _xla_ffi, api, options, validate

__all__ = ["flash_attn", "flash_attn_varlen", "forward_with_lse", "varlen_forward_with_lse", "flash_attn_with_kvcache"]

_FORWARD, _BACKWARD = "cupyflash_flash_attn_fwd", "cupyflash_flash_attn_bwd"
_KVCACHE = "cupyflash_flash_attn_with_kvcache"
_VARLEN_FORWARD, _VARLEN_BACKWARD = "cupyflash_flash_attn_varlen_fwd", "cupyflash_flash_attn_varlen_bwd"
_GRAPH = "_graph"  # each attention target's twin that XLA may capture into a CUDA graph (_attention_call)

# JAX's name of the seed option (a key array rather than the core's int).
_PUBLIC_NAMES = {"seed": "dropout_seed"}


def _public_name(option):
    return _PUBLIC_NAMES.get(option.name, option.name)


def _takes_options(varlen):
    """Gives a function the keyword options of cupyflash.options in its signature (every option of
    either pass: the custom_vjp's backward uses the forward's)."""
    def decorate(function):
        options.add_to_signature(function, options.for_call("bwd", varlen), _public_name)
        return function
    return decorate


@_takes_options(varlen=False)
def flash_attn(q, k, v, softmax_scale=None, causal=False, **given):
    """softmax(q k^T * softmax_scale) v for JAX arrays, differentiable in q, k, v and the bias.

    q is (batch, seqlen_q, nheads, headdim), k and v are (batch, seqlen_k, nheads_k, headdim),
    as in flash_attn's flash_attn_func; softmax_scale defaults to headdim ** -0.5; causal masking
    is aligned bottom-right (query i sees key j iff j <= i + seqlen_k - seqlen_q). On the GPU,
    q, k and v must be float16 or bfloat16; on the CPU any float type runs the NumPy reference.

    Options, as cupyflash.flash_attn_func takes them (cupyflash.options). Static (Python values
    under jit): softmax_scale, causal and the pair, real and flag options. Arrays: the array
    options; attn_bias gets its gradient where it is differentiated (an argument of jax.grad or
    jax.vjp, or computed from one): only then does the backward compute dbias, so a constant bias,
    one outside grad's argnums or one under jax.lax.stop_gradient costs nothing extra; the others
    get a zero cotangent.
    dropout_seed, needed when dropout is on: the Philox key of the dropout mask
    (the backward uses the same), either a uint32 array of shape (2,) (low word, high word; e.g.
    jax.random.bits(key, (2,), jnp.uint32)): a traced operand, so a new seed each step does not
    retrace; or a Python int in [0, 2**64), which becomes a constant of the program. See the module
    docstring for how the seed reaches the kernels.
    """
    static, operands = _prepare(q, k, v, softmax_scale, causal, given, "flash_attn")
    return _flash_attn(q, k, v, operands, static)


@_takes_options(varlen=True)
def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                      causal=False, *, block_table=None, **given):
    """flash_attn over sequences of different lengths packed without padding, differentiable in q, k, v.

    q is (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim); sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v.
    cu_seqlens_q and cu_seqlens_k are int32 arrays of length batch + 1 (operands: they may change
    without a retrace; on the CPU the handler checks their values, on the GPU the kernels read
    them where XLA wrote them and clamp each sequence into the packed arrays, unchecked);
    max_seqlen_q and max_seqlen_k are static ints at least every length. Options as in flash_attn
    but those the varlen functions do not take; masks are per sequence.
    With block_table (int32 (batch, pages per sequence)), k and v are a paged cache (num_blocks,
    page_size, nheads_k, headdim) read as cupyflash.flash_attn_varlen_func reads it (prefill from a
    paged cache): the sequences' keys are gathered into packed arrays on the device, with no host
    read (so under jit and in XLA's graphs too), and the gradients of k and v reach the caches. The
    block table's values and the lengths against it are checked where they are concrete (eager
    calls, on the host); traced, a block outside the cache reads a clamped one.
    """
    k, v, varlen, given = _packing(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, given)
    static, operands = _prepare(q, k, v, softmax_scale, causal, given, "flash_attn_varlen", varlen)
    return _flash_attn(q, k, v, operands, static)


def _packing(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, given):
    """(k, v, validate.Varlen, given) of a varlen call; with block_table, k and v are a paged cache
    whose keys are gathered on the device (_paged.packed_from_pages), its values checked where they
    are concrete."""
    varlen = validate.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if block_table is not None:
        validate.check_paged_varlen_shapes(q, k, v, varlen, block_table)
        if not any(isinstance(x, jax.core.Tracer) for x in (cu_seqlens_k, block_table)):
            validate.check_paged_varlen_values(numpy.asarray(cu_seqlens_k), numpy.asarray(block_table), k)
        k, v, cu_q, cu_k, slopes = _paged.packed_from_pages(jnp, k, v, varlen, block_table, given.get("alibi_slopes"))
        varlen = validate.Varlen(cu_q, cu_k, max_seqlen_q, max_seqlen_k)
        given = given if slopes is None else dict(given, alibi_slopes=slopes)
    if q.shape[0] == 0 and _concrete_on_the_cpu(varlen.cu_seqlens_q, varlen.cu_seqlens_k):
        # XLA skips a call whose results have no elements, and the CPU handler's check of the
        # packing with it: the same check here, where the values are at hand.
        validate.check_packing(varlen, numpy.asarray(varlen.cu_seqlens_q), numpy.asarray(varlen.cu_seqlens_k), 0,
                               k.shape[0])
    return k, v, varlen, given


@_takes_options(varlen=False)
def forward_with_lse(q, k, v, softmax_scale=None, causal=False, **given):
    """(out, lse) of the forward custom call, not differentiable: lse is (batch, nheads, seqlen_q)
    float32. Options as in flash_attn (the backward's have no effect). For tests and for callers that merge
    partial attention results."""
    static, operands = _prepare(q, k, v, softmax_scale, causal, given, "forward_with_lse")
    return _forward(q, k, v, operands, static)


@_takes_options(varlen=False)
def backward_with_stats(dout, q, k, v, out, lse, softmax_scale=None, causal=False, **given):
    """(dq, dk, dv) of flash_attn from the forward's out and lse, not differentiable: the backward
    takes its probabilities from lse and its softmax row terms from out, so that a call over part of
    the keys gives that part's share of the whole softmax's gradients (ring attention)."""
    static, operands = _prepare(q, k, v, softmax_scale, causal, given, "backward_with_stats")
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    return tuple(_attention_call(static, "bwd", results, [dout.astype(q.dtype), q, k, v, out, lse,
                                                          *_operand_list(operands, static)]))


@_takes_options(varlen=True)
def varlen_forward_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                            causal=False, *, block_table=None, **given):
    """(out, lse) of flash_attn_varlen's forward, not differentiable: lse is (nheads, total_q) float32.
    block_table as flash_attn_varlen takes it."""
    k, v, varlen, given = _packing(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, given)
    static, operands = _prepare(q, k, v, softmax_scale, causal, given, "varlen_forward_with_lse", varlen)
    return _forward(q, k, v, operands, static)


_KVCACHE_OPERANDS = validate.KVCACHE_ARRAYS + ("alibi_slopes",)  # after q, k_cache, v_cache, each where given


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash_attn_with_kvcache, functional: returns (out, k_cache, v_cache), the caches with k and v
    appended (and lse after out with return_softmax_lse). cupyflash.flash_attn_with_kvcache has the
    semantics. The caches are the custom call's results aliased to its operands: under jax.jit with
    them donated (donate_argnums) XLA writes them in place. CPU arrays run the NumPy reference, GPU
    arrays the core's GPU path (cupyflash/_kvcache.py) on XLA's stream."""
    if validate.seqlens_given_as_int(cache_seqlens):
        cache_seqlens = jnp.full((q.shape[0],), validate.check_seqlens_int(cache_seqlens), jnp.int32)
    given = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    call, cache = validate.check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                         cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, given,
                                         rotary_interleaved, num_splits, traced=True)
    return_softmax_lse = validate.check_flag("return_softmax_lse", return_softmax_lse)
    present = dict(k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
                   cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
                   alibi_slopes=alibi_slopes)
    operands = [q, k_cache, v_cache] + [present[name] for name in _KVCACHE_OPERANDS if present[name] is not None]
    attrs = {"softmax_scale": numpy.float64(call.scale), "causal": numpy.bool_(call.causal),
             "rotary_interleaved": numpy.bool_(cache.rotary_interleaved), "num_splits": numpy.int64(cache.num_splits)}
    for option in options.for_call("kvcache"):
        if option.kind != "array":  # the window unfolded: causal travels on its own
            value = options.window_bounds(False, window_size) if option.kind == "pair" else call.checked[option.name]
            attrs.update(_encode(option, value))
    attrs.update({f"has_{name}": numpy.bool_(True) for name in _KVCACHE_OPERANDS if present[name] is not None})
    stats = (q.shape[0], q.shape[2], q.shape[1])
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(stats, validate.lse_dtype(call.dtype)),
               jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    out, lse, k_cache, v_cache = jax.ffi.ffi_call(_KVCACHE, results, input_output_aliases={1: 2, 2: 3},
                                                  vmap_method="sequential")(*operands, **attrs)
    return (out, lse, k_cache, v_cache) if return_softmax_lse else (out, k_cache, v_cache)


def _kvcache_handler(platform):
    """Runs flash_attn_with_kvcache on XLA's buffers: the NumPy path on the CPU, the GPU path on XLA's
    device and stream. The caches are the results aliased to the operands, so the append lands in
    them in place."""
    def handler(call):
        attrs = call.attrs
        names = ["q", "k_cache", "v_cache"] + [name for name in _KVCACHE_OPERANDS if attrs.get(f"has_{name}")]
        if platform == "cpu":
            _run_kvcache(attrs, dict(zip(names, (a.numpy() for a in call.args))), [r.numpy() for r in call.rets])
            return
        import cupy
        device, stream = _device(call), call.cuda_stream()
        # (the values of the lengths and the block table stay on the device: reading them would wait
        # for XLA's stream inside its own call)
        with cupy.cuda.Device(device), _arrays.external_stream(stream, device), validate.no_host_sync():
            _run_kvcache(attrs, dict(zip(names, (a.cupy(device) for a in call.args))),
                         [r.cupy(device) for r in call.rets])
    return handler


def _run_kvcache(attrs, arrays, results):
    out, lse, k_cache, v_cache = results
    for name, result in (("k_cache", k_cache), ("v_cache", v_cache)):
        if _address(result) != _address(arrays[name]):  # not aliased in place: the result starts as the operand
            result[...] = arrays[name]
    given = {option.name: _decode(option, attrs) for option in options.for_call("kvcache") if option.kind != "array"}
    results = api.flash_attn_with_kvcache(
        arrays["q"], k_cache, v_cache, *(arrays.get(name) for name in validate.KVCACHE_ARRAYS),
        softmax_scale=float(attrs["softmax_scale"]), causal=bool(attrs["causal"]),
        rotary_interleaved=bool(attrs["rotary_interleaved"]), num_splits=int(attrs["num_splits"]),
        alibi_slopes=arrays.get("alibi_slopes"), return_softmax_lse=True, **given)
    out[...] = results[0]
    lse[...] = results[1]


def _address(array):
    return array.ctypes.data if isinstance(array, numpy.ndarray) else array.data.ptr


@dataclasses.dataclass(frozen=True)
class _Static:
    """The static part of a call (a nondiff argument of the custom_vjp): the scale, causal, the
    options that are Python values (by name, checked), the names of the operands after q, k, v,
    and the varlen maxima."""
    softmax_scale: float
    causal: bool
    values: tuple              # ((name, value), ...) of the pair, real and flag options
    operands: tuple
    max_seqlens: tuple = None  # (max_seqlen_q, max_seqlen_k) for varlen

    def attributes(self, pass_, return_dbias=False):
        """The custom call's attributes: a float64 scale keeps it exact, a bool arrives as PRED.
        Options that are off are left out (the handlers read them as off), so that a call without
        options is the custom call it always was; so is return_dbias (the backward's dbias)."""
        attrs = {"softmax_scale": numpy.float64(self.softmax_scale), "causal": numpy.bool_(self.causal)}
        if return_dbias:
            attrs["return_dbias"] = numpy.bool_(True)
        taken = {o.name for o in options.for_call(pass_, self.max_seqlens is not None)}
        for name, value in self.values:
            option = options.by_name(name)
            if name in taken and option.is_on(value):
                attrs.update(_encode(option, value))
        attrs.update({f"has_{name}": numpy.bool_(True) for name in self.operands
                      if name in taken and options.by_name(name).kind == "array"})
        if self.max_seqlens is not None:
            attrs.update(max_seqlen_q=numpy.int64(self.max_seqlens[0]), max_seqlen_k=numpy.int64(self.max_seqlens[1]))
        return attrs

    @property
    def targets(self):
        return (_FORWARD, _BACKWARD) if self.max_seqlens is None else (_VARLEN_FORWARD, _VARLEN_BACKWARD)


def _encode(option, value):
    """The attributes of an option's value."""
    if option.kind == "pair":
        return {part: numpy.int64(side) for part, side in zip(option.parts, value)}
    return {option.name: numpy.float64(value) if option.kind == "real" else numpy.bool_(value)}


def _decode(option, attrs):
    """An option's value from the attributes (its default where they leave it out)."""
    if option.kind == "pair":
        return tuple(int(attrs.get(part, side)) for part, side in zip(option.parts, option.default))
    value = attrs.get(option.name, option.default)
    return float(value) if option.kind == "real" else bool(value)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_attn(q, k, v, operands, static):
    return _forward(q, k, v, operands, static)[0]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Gradients:
    """The operands whose gradient the backward computes (a static residual)."""
    names: tuple


_WITH_GRADIENT = tuple(o.name for o in options.OPTIONS if o.gradient)


def _flash_attn_fwd(q, k, v, operands, static):
    # The primals come wrapped with `perturbed` (symbolic_zeros=True): whether each is
    # differentiated, which is all that tells a wanted dbias from a wasted one.
    values = {name: primal.value for name, primal in operands.items()}
    out, lse = _forward(q.value, k.value, v.value, values, static)
    wanted = _Gradients(tuple(name for name in _WITH_GRADIENT if name in operands and operands[name].perturbed))
    return out, (q.value, k.value, v.value, values, out, lse, wanted)


def _flash_attn_bwd(static, residuals, dout):
    q, k, v, operands, out, lse, wanted = residuals
    if isinstance(dout, jax.custom_derivatives.SymbolicZero):
        return None, None, None, {name: None for name in operands}
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    results += [jax.ShapeDtypeStruct(operands[name].shape, operands[name].dtype) for name in wanted.names]
    grads = _attention_call(static, "bwd", results, [dout.astype(q.dtype), q, k, v, out, lse,
                                                     *_operand_list(operands, static)], bool(wanted.names))
    # Cotangents of the operands: their gradient where it was wanted; none (zero) for the rest.
    by_name = dict(zip(wanted.names, grads[3:]))
    return (*grads[:3], {name: by_name.get(name) for name in operands})


_flash_attn.defvjp(_flash_attn_fwd, _flash_attn_bwd, symbolic_zeros=True)


def _forward(q, k, v, operands, static):
    nheads = q.shape[-2]
    stats = (nheads, q.shape[0]) if static.max_seqlens is not None else (q.shape[0], nheads, q.shape[1])
    lse_dtype = validate.lse_dtype(numpy.dtype(q.dtype).name)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(stats, lse_dtype))
    return tuple(_attention_call(static, "fwd", results, [q, k, v, *_operand_list(operands, static)]))


def _attention_call(static, pass_, results, operands, return_dbias=False):
    """The results of a forward's or backward's custom call. Traced for a CUDA device, a call that
    can run without allocating or copying (the kernels' dtypes, a head dim the core does not pad, no
    dbias) goes to its target's graph twin, which XLA may capture into a CUDA graph: its launch is
    built now, outside any capture, and the backward's scratch comes from XLA as extra results."""
    target = static.targets[pass_ == "bwd"]
    attrs = static.attributes(pass_, return_dbias)
    q = operands[_LEADING[pass_].index("q")]
    device = None
    if not return_dbias and numpy.dtype(q.dtype).name in validate.GPU_DTYPES:
        device = _trace_device(operands)
    if device is not None:
        signature = _signature(target + _GRAPH, attrs, operands, results)
        launch = _traced_launch(signature, target + _GRAPH, pass_, static, attrs, operands, device)
        if launch.plan is not None:  # (none: a head dim the core pads)
            return _custom_call(target + _GRAPH, results, operands, attrs, signature, launch.plan.scratch_sizes)
    return _custom_call(target, results, operands, attrs)


def _custom_call(target, results, operands, attrs, signature=None, scratch=()):
    """The custom call's results, its signature added to its attributes; `scratch` are the byte sizes
    of workspaces XLA gives the kernels as extra uint8 results, dropped here. Inside jax.shard_map
    the results vary over the manual axes any operand varies over (XLA runs the call on each
    device's own values; typed as invariant, a result used as a residual would reach the backward
    as one device's copy)."""
    if signature is None:
        signature = _signature(target, attrs, operands, results)
    attrs[_SIGNATURE] = numpy.int64(signature)
    workspaces = [jax.ShapeDtypeStruct((size,), jnp.uint8) for size in scratch]
    outputs = jax.ffi.ffi_call(target, (*results, *workspaces), vmap_method="sequential")(*operands, **attrs)
    axes = frozenset().union(*(varying_axes(x) for x in operands))
    return type(outputs)(varying(x, axes) for x in outputs[:len(results)])


def _concrete_on_the_cpu(*arrays):
    """Whether these arrays have values now (an eager call's), all on XLA's CPU backend, which runs
    the NumPy reference and checks what it does (the GPU's kernels read a packing unchecked)."""
    return all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
               and all(d.platform == "cpu" for d in x.devices()) for x in arrays)


def _trace_device(operands):
    """The CUDA device (CuPy's id) a call traced now is to run on: a concrete operand's (an eager
    call), else JAX's default device; None where that is no GPU (the CPU backend runs the NumPy
    reference, which allocates)."""
    device = next((next(iter(x.devices())) for x in operands
                   if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)), None)
    if device is None:
        device = jax.config.jax_default_device
        if device is None or isinstance(device, str):
            device = jax.local_devices(backend=device)[0]
    return device.local_hardware_id if device.platform == "gpu" else None


def _traced_launch(signature, target, pass_, static, attrs, operands, device):
    """The launch of a graph target's call on `device`, built while tracing (planning compiles and
    loads kernels, which a CUDA graph capture would not allow) and kept where the CUDA handler
    finds it by the call's signature."""
    key = (signature, device, _config.forced_choices())
    launch = _launches.get(key)
    if launch is None:
        request = _Request.of_attributes(attrs, target, pass_, static.max_seqlens is not None)
        launch = _new_launch(request, _placeholders(operands, device), device)
        if launch.plan is not None:
            launch = _Launch(dataclasses.replace(request, scratch=launch.plan.scratch_sizes), launch.plan)
        _remember(key, launch)
    return launch


_placeholder_memory = {}  # device -> the allocation every placeholder of a traced launch points at


def _placeholders(operands, device):
    """CuPy arrays of the operands' shapes and dtypes, contiguous as XLA's buffers are, all at one
    small allocation: planning reads their layouts (and aims TMA descriptors, re-aimed by every
    call), never their memory."""
    import cupy
    with cupy.cuda.Device(device):
        memory = _placeholder_memory.get(device)
        if memory is None:
            memory = _placeholder_memory[device] = cupy.cuda.alloc(_PLACEHOLDER_BYTES)
        views = []
        for x in operands:
            dtype = numpy.dtype(x.dtype)
            size = int(numpy.prod(x.shape, dtype=numpy.int64)) * dtype.itemsize
            pointer = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(memory.ptr, size, memory, device), 0)
            views.append(cupy.ndarray(x.shape, dtype, pointer))
    return views


_PLACEHOLDER_BYTES = 512


def varying_axes(x):
    """The manual mesh axes x varies over inside jax.shard_map (its type's `manual_axis_type`, or
    `vma` in older JAX; none outside)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return manual.varying if manual is not None else frozenset(getattr(aval, "vma", ()))


def varying(x, axes):
    """x typed as varying over `axes` too (the values unchanged)."""
    axes = tuple(sorted(frozenset(axes) - varying_axes(x)))
    if not axes:
        return x
    return jax.lax.pcast(x, axes, to="varying") if hasattr(jax.lax, "pcast") else jax.lax.pvary(x, axes)


_SIGNATURE = "_signature"  # first of the attributes, which XLA sorts by name: the CUDA handlers read it by one load


def _signature(target, attrs, operands, results):
    """A 64-bit digest of all a custom call's launch depends on but its buffers' addresses: the
    target, the attributes (but the signature) and the operands' and results' shapes and dtypes.
    The same from the traced call as from the frame the handlers get (they check it)."""
    text = repr((target, sorted((name, value.item() if isinstance(value, numpy.generic) else value)
                                for name, value in attrs.items() if name != _SIGNATURE),
                 [(tuple(x.shape), numpy.dtype(x.dtype).name) for x in (*operands, *results)]))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _operand_list(operands, static):
    return [operands[name] for name in static.operands]


# --------------------------------------------------------------------------------------------
# Checks at trace time (shapes and dtypes are known then); the core repeats them at run time.

def _prepare(q, k, v, softmax_scale, causal, given, function, varlen=None):
    """(_Static, operands by name) of a call, after the core's argument checks. The NumPy path's
    dtypes are allowed at trace time (CPU arrays run the reference); on the GPU the core refuses
    what its kernels cannot take when the custom call runs. Values of traced arrays (cu_seqlens,
    the seed) are checked when the call runs."""
    taken = options.for_call("bwd", varlen is not None)
    names = {_public_name(o): o for o in taken}
    for name in given:
        if name not in names:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    operands = {}
    if varlen is not None:
        validate.check_varlen_shapes(q, k, varlen)
        operands.update(cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_k)
        varlen = validate.Varlen(varlen.cu_seqlens_q, varlen.cu_seqlens_k, int(varlen.max_seqlen_q),
                                 int(varlen.max_seqlen_k))
    shape = validate.check_qkv(q, k, v, varlen)
    dtype = numpy.dtype(q.dtype).name
    # Options are checked as for a non-causal call: causal travels as an attribute of its own, and
    # the handler's core call folds it in.
    call = validate.Call("bwd", _arrays.Caller("numpy", -1), shape, dtype,
                         validate.check_scale(softmax_scale, shape.headdim), False, {}, varlen)
    causal = validate.check_flag("causal", causal)
    values = []
    for public, option in names.items():
        value = given.get(public, option.default)
        if option.kind == "seed":
            continue
        checked = option.check(value, call)
        call.checked[option.name] = checked
        if option.kind == "array":
            if checked is not None:
                operands[option.name] = checked
        else:
            values.append((option.name, checked))
    for option in taken:
        if "seed" in option.needs and call.checked.get(option.name):
            operands["seed"] = _seed_operand(given.get(_PUBLIC_NAMES["seed"]))
    static = _Static(call.scale, causal, tuple(values), tuple(name for name in operands),
                     None if varlen is None else (varlen.max_seqlen_q, varlen.max_seqlen_k))
    return static, operands


def _seed_operand(seed):
    """The dropout seed as the custom calls take it: a uint32 (2,) array (low word, high word)."""
    if seed is None:
        raise ValueError("dropout_seed is required when dropout_p > 0: a uint32 array of shape (2,) "
                         "(e.g. jax.random.bits(key, (2,), jnp.uint32)) or an int in [0, 2**64)")
    if isinstance(seed, (numbers.Integral, numpy.integer)) and not isinstance(seed, (bool, numpy.bool_)):
        if not 0 <= seed < 2 ** 64:
            raise ValueError(f"dropout_seed must be in [0, 2**64), got {seed}")
        seed = int(seed)
        return jnp.asarray(numpy.array([seed & 0xFFFFFFFF, seed >> 32], numpy.uint32))
    if not hasattr(seed, "dtype") or numpy.dtype(seed.dtype) != numpy.uint32 or tuple(seed.shape) != (2,):
        raise TypeError(f"dropout_seed must be a uint32 array of shape (2,) or an int in [0, 2**64), got "
                        f"{getattr(seed, 'dtype', type(seed).__name__)} {tuple(getattr(seed, 'shape', ()))}")
    return seed


# --------------------------------------------------------------------------------------------
# The handlers, run by XLA at execution (see _xla_ffi.Call for what they get).

_LEADING = {"fwd": ("q", "k", "v"), "bwd": ("dout", "q", "k", "v", "out", "lse")}
_RESULTS = {"fwd": ("out", "lse"), "bwd": ("dq", "dk", "dv")}  # Plan.run's names for the custom call's results


@dataclasses.dataclass
class _Request:
    """What one custom call asks for, from its attributes: the operands' names and the core's
    arguments; for a graph target's, the byte sizes of the scratch results XLA gives it."""
    target: str
    pass_: str
    names: list
    scale: float
    causal: bool
    values: dict
    max_seqlens: tuple
    return_dbias: bool
    scratch: tuple = ()

    @classmethod
    def of_attributes(cls, attrs, target, pass_, varlen):
        names = list(_LEADING[pass_])
        if varlen:
            names += ["cu_seqlens_q", "cu_seqlens_k"]
        values = {}
        taken = options.for_call(pass_, varlen)
        for option in taken:
            if option.kind == "array":
                if attrs.get(f"has_{option.name}"):
                    names.append(option.name)
            elif option.kind != "seed":
                values[option.name] = _decode(option, attrs)
        # A seed operand comes last, there whenever an option that needs it is on.
        names += [o.name for o in taken if o.kind == "seed" and any(
            o.name in other.needs and other.is_on(values.get(other.name)) for other in taken)]
        max_seqlens = (int(attrs["max_seqlen_q"]), int(attrs["max_seqlen_k"])) if varlen else None
        return cls(target, pass_, names, float(attrs["softmax_scale"]), bool(attrs["causal"]), values, max_seqlens,
                   bool(attrs.get("return_dbias", False)))

    @classmethod
    def of(cls, call, target, pass_, varlen):
        """The request of a call frame, checked against its operands, results and signature."""
        attrs = call.attrs
        request = cls.of_attributes(attrs, target, pass_, varlen)
        if len(request.names) != len(call.args):
            raise ValueError(f"the custom call has {len(call.args)} operands, expected {len(request.names)}: "
                             f"{', '.join(request.names)}")
        results = len(_RESULTS[pass_]) + request.return_dbias
        scratch = call.rets[results:] if target.endswith(_GRAPH) else ()
        if len(call.rets) - len(scratch) != results:
            raise ValueError(f"the custom call has {len(call.rets)} results, expected {results}")
        signature = attrs.get(_SIGNATURE)
        if signature is not None and signature != _signature(target, attrs, call.args, call.rets[:results]):
            raise ValueError(f"{target}: the {_SIGNATURE} attribute does not match the call")
        request.scratch = tuple(ret.nbytes for ret in scratch)
        return request

    def core_call(self, operands):
        """api._call's and api.plan_of's arguments for the operands (NumPy or CuPy arrays, in
        self.names order); the seed operand is passed as the array it is (the kernels read it)."""
        arrays = dict(zip(self.names, operands))
        given = dict(self.values)
        for option in options.for_call(self.pass_, self.max_seqlens is not None):
            if option.kind in ("array", "seed") and option.name in arrays:
                given[option.name] = arrays.pop(option.name)
        varlen = None
        if self.max_seqlens is not None:
            varlen = validate.Varlen(arrays.pop("cu_seqlens_q"), arrays.pop("cu_seqlens_k"), *self.max_seqlens)
        return (self.pass_, arrays, self.scale, self.causal, given, self.target, varlen, self.return_dbias)

    def run(self, operands):
        """The core's results for the operands: (out, lse), or (dq, dk, dv) and dbias if asked for."""
        return api._call(*self.core_call(operands))

    def outputs(self, rets):
        """The results among a frame's (all but the scratch)."""
        return rets[:len(rets) - len(self.scratch)]


def _cpu_handler(target, pass_, varlen):
    def handler(call):
        request = _Request.of(call, target, pass_, varlen)
        results = request.run([a.numpy() for a in call.args])
        for ret, result in zip(request.outputs(call.rets), results, strict=True):
            if numpy.size(result):  # (XLA hands a result without elements as a read-only view)
                numpy.copyto(ret.numpy(), result)
    return handler


# --- CUDA: the kernels write XLA's result buffers, on XLA's stream -------------------------

class _Launch:
    """A CUDA custom call's cached launch (per signature and device): the core's plan and how the
    frame's buffers map to its names. `plan` is None where none runs the call (a head dim that is
    not a multiple of 8: the core pads and cuts, and the results are copied). A graph target's
    plan takes its workspaces from XLA's scratch results, which hold them unless the program was
    traced for another kind of GPU (then it allocates, as other targets do, but never under a capture)."""

    def __init__(self, request, plan):
        self.request, self.plan, self.names = request, plan, request.names
        self.results = _RESULTS[request.pass_]
        self.dbias = request.return_dbias
        self.graph = request.target.endswith(_GRAPH)
        self.xla_scratch = self.graph and plan is not None and _holds(request.scratch, plan.scratch_sizes)

    def run(self, call, device, stream):
        """Runs the plan on the call's buffers; False where it cannot (an address not aligned as
        the kernels need). A call that allocates (the backward's scratch, where XLA gives none and
        the plan keeps none for XLA's stream yet, and dbias) runs with XLA's stream current in CuPy,
        whose pool reuses a block on the stream that was current when it was freed."""
        plan, rets = self.plan, call.ret_pointers()
        arrays, into = dict(zip(self.names, call.arg_pointers())), dict(zip(self.results, rets))
        if self.xla_scratch:
            return plan.run(arrays, None, into, stream, workspaces=rets[len(self.results):]) is not None
        if not (self.dbias or plan.allocates_on(stream, self.results)):
            return plan.run(arrays, None, into, stream) is not None
        if self.graph:
            _refuse_under_capture(stream, "its scratch results were sized for another GPU (trace the program "
                                          "with the GPU that runs it as JAX's default device)")
        import cupy
        with cupy.cuda.Device(device), _arrays.external_stream(stream, device):
            results = plan.run(arrays, None, into, stream)
            if results is not None and self.dbias:  # reduced by CuPy from the kernels' float32 accumulator
                _copy(rets[3], results[3], stream)
        return results is not None


def _holds(given, needed):
    """Whether scratch results of the `given` byte sizes hold workspaces of the `needed` ones."""
    return len(given) == len(needed) and all(g >= n for g, n in zip(given, needed))


_launches = {}  # (signature, device, CUPYFLASH_TILES and _FAMILY) -> _Launch
_MAX_LAUNCHES = 4096  # custom calls seen by one process; past this the cache starts afresh


def _remember(key, launch):
    if len(_launches) >= _MAX_LAUNCHES:
        _launches.clear()
    _launches[key] = launch


def _cuda_handler(target, pass_, varlen):
    """Runs the kernels on XLA's device and stream, writing XLA's result buffers. A repeated call
    (its signature attribute seen before on this device) reads its buffers' addresses and the
    stream from the frame and runs the cached plan: nothing is decoded, allocated (but the
    backward's scratch where XLA gives none) or read from the device. XLA may record a graph
    target's first call on a device into a command buffer by stream capture; a launch that tracing
    did not build (for another device, say) is then built on a thread of its own, which CUDA's
    thread-local capture mode leaves free to load kernels."""
    graph = target.endswith(_GRAPH)

    def handler(call):
        signature = call.first_scalar(_SIGNATURE_BYTES)
        device = _device(call)
        key = (signature, device, _config.forced_choices())  # a forced tile table or family is part of a plan
        launch = _launches.get(key)
        stream = call.cuda_stream()
        if launch is None:
            build = functools.partial(_launch_of, call, target, pass_, varlen, device, stream)
            launch = _on_another_thread(build) if graph and _capturing(stream) else build()
            if signature is not None:
                _remember(key, launch)
        if launch.plan is None or not launch.run(call, device, stream):
            if graph:
                _refuse_under_capture(stream, "the call copies (an address the kernels cannot take)")
            _run_copying(launch.request, call, device, stream)
    return handler


_SIGNATURE_BYTES = _SIGNATURE.encode()


def _launch_of(call, target, pass_, varlen, device, stream):
    return _new_launch(_Request.of(call, target, pass_, varlen), [a.cupy(device) for a in call.args], device, stream)


def _new_launch(request, operands, device, stream=None):
    """The launch of a request on `device` from CuPy arrays with its operands' layouts (XLA's
    buffers, or placeholders while tracing), checked and planned as the core does."""
    import cupy
    with contextlib.ExitStack() as context:
        context.enter_context(cupy.cuda.Device(device))
        if stream is not None:
            context.enter_context(_arrays.external_stream(stream, device))
        context.enter_context(validate.no_host_sync())
        plan = api.plan_of(*request.core_call(operands))
    return _Launch(request, plan)


def _capturing(stream):
    import cupy
    return cupy.cuda.runtime.streamIsCapturing(stream) != 0  # not cudaStreamCaptureStatusNone


def _refuse_under_capture(stream, why):
    """Raises where XLA is capturing the call into a CUDA graph: CuPy's pool would hand a block
    allocated now to other arrays while the graph's replays still write it."""
    if _capturing(stream):
        raise RuntimeError(f"cupyflash: this call cannot run inside a CUDA graph capture: {why}")


def _on_another_thread(function):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(function).result()


def _run_copying(request, call, device, stream):
    """The core's own path (results in CuPy arrays, then copied into XLA's): for head dims that
    are not a multiple of 8, and for buffers the plan cannot take by address."""
    import cupy
    with cupy.cuda.Device(device), _arrays.external_stream(stream, device), validate.no_host_sync():
        results = request.run([a.cupy(device) for a in call.args])
        for ret, result in zip(request.outputs(call.ret_pointers()), results, strict=True):
            _copy(ret, cupy.ascontiguousarray(result), stream)


def _copy(pointer, source, stream):
    import cupy
    cupy.cuda.runtime.memcpyAsync(pointer, source.data.ptr, source.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
                                  stream)


@functools.cache
def _one_device():
    import cupy
    return cupy.cuda.runtime.getDeviceCount() == 1


def _device(call):
    """The call's CUDA device: 0 where the process sees one, else XLA's answer (one API call)."""
    return 0 if _one_device() else call.device_ordinal()


_handlers = {}  # (target, platform) -> the capsule XLA was given (tests ask it for its metadata)


def _register():
    """Every target on both platforms; each attention target with its graph twin, which tells XLA
    that it may trace it into a command buffer."""
    targets = {(_FORWARD, "fwd", False), (_BACKWARD, "bwd", False), (_VARLEN_FORWARD, "fwd", True),
               (_VARLEN_BACKWARD, "bwd", True)}
    for name, pass_, varlen in sorted(targets):
        for target, traits in ((name, 0), (name + _GRAPH, _xla_ffi.COMMAND_BUFFER_COMPATIBLE)):
            for platform, make in (("cpu", _cpu_handler), ("CUDA", _cuda_handler)):
                _register_target(target, platform, make(target, pass_, varlen), traits)
    for platform in ("cpu", "CUDA"):
        _register_target(_KVCACHE, platform, _kvcache_handler(platform))


def _register_target(target, platform, handler, traits=0):
    capsule = _handlers[target, platform] = _xla_ffi.handler_capsule(handler, traits)
    jax.ffi.register_ffi_target(target, capsule, platform=platform)


_register()  # once per process: the module is imported once


from .jax_ring import ring_flash_attn, shard_sequence, unshard_sequence  # noqa: E402,F401  (context parallelism)
