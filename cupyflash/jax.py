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
varlen cu_seqlens are operands (traced arrays). An array option with a gradient gets it, the
others a zero cotangent.

What goes through the host: the dropout seed and the cu_seqlens are read by the handler on the host
(on the GPU a small device-to-host copy that waits for XLA's stream to reach the call), as the core
checks cu_seqlens on the host and writes the seed into the kernels' parameters.

GPU memory: the kernels' outputs and the backward's scratch come from CuPy's memory pool, beside
XLA's own; XLA takes 75% of the GPU at start unless XLA_PYTHON_CLIENT_PREALLOCATE=false (or a
smaller XLA_PYTHON_CLIENT_MEM_FRACTION) leaves CuPy more.
"""

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy

from . import _arrays, _xla_ffi, api, options, validate

__all__ = ["flash_attn", "flash_attn_varlen", "forward_with_lse", "varlen_forward_with_lse"]

_FORWARD, _BACKWARD = "cupyflash_flash_attn_fwd", "cupyflash_flash_attn_bwd"
_VARLEN_FORWARD, _VARLEN_BACKWARD = "cupyflash_flash_attn_varlen_fwd", "cupyflash_flash_attn_varlen_bwd"

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
    options; one with a gradient gets it in every backward (pass it only where it is wanted, or wrap
    it in jax.lax.stop_gradient and accept the cost), the others a zero cotangent.
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
                      causal=False, **given):
    """flash_attn over sequences of different lengths packed without padding, differentiable in q, k, v.

    q is (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim); sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v.
    cu_seqlens_q and cu_seqlens_k are int32 arrays of length batch + 1 (operands: they may change
    without a retrace; the handler checks their values on the host when the call runs);
    max_seqlen_q and max_seqlen_k are static ints at least every length. Options as in flash_attn
    but those the varlen functions do not take; masks are per sequence.
    """
    varlen = validate.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    static, operands = _prepare(q, k, v, softmax_scale, causal, given, "flash_attn_varlen", varlen)
    return _flash_attn(q, k, v, operands, static)


@_takes_options(varlen=False)
def forward_with_lse(q, k, v, softmax_scale=None, causal=False, **given):
    """(out, lse) of the forward custom call, not differentiable: lse is (batch, nheads, seqlen_q)
    float32. Options as in flash_attn (the backward's have no effect). For tests and for callers that merge
    partial attention results."""
    static, operands = _prepare(q, k, v, softmax_scale, causal, given, "forward_with_lse")
    return _forward(q, k, v, operands, static)


@_takes_options(varlen=True)
def varlen_forward_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                            causal=False, **given):
    """(out, lse) of flash_attn_varlen's forward, not differentiable: lse is (nheads, total_q) float32."""
    varlen = validate.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    static, operands = _prepare(q, k, v, softmax_scale, causal, given, "varlen_forward_with_lse", varlen)
    return _forward(q, k, v, operands, static)


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

    def attributes(self, pass_):
        """The custom call's attributes: a float64 scale keeps it exact, a bool arrives as PRED.
        Options that are off are left out (the handlers read them as off), so that a call without
        options is the custom call it always was."""
        attrs = {"softmax_scale": numpy.float64(self.softmax_scale), "causal": numpy.bool_(self.causal)}
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


def _flash_attn_fwd(q, k, v, operands, static):
    out, lse = _forward(q, k, v, operands, static)
    return out, (q, k, v, operands, out, lse)


def _flash_attn_bwd(static, residuals, dout):
    q, k, v, operands, out, lse = residuals
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    gradients = [o.name for o in options.OPTIONS if o.gradient and o.name in static.operands]
    results += [jax.ShapeDtypeStruct(operands[name].shape, operands[name].dtype) for name in gradients]
    call = jax.ffi.ffi_call(static.targets[1], results, vmap_method="sequential")
    grads = call(dout.astype(q.dtype), q, k, v, out, lse, *_operand_list(operands, static),
                 **static.attributes("bwd"))
    # Cotangents of the operands: their gradient where they have one; none (zero) for the rest.
    by_name = dict(zip(gradients, grads[3:]))
    return (*grads[:3], {name: by_name.get(name) for name in operands})


_flash_attn.defvjp(_flash_attn_fwd, _flash_attn_bwd)


def _forward(q, k, v, operands, static):
    nheads = q.shape[-2]
    stats = (nheads, q.shape[0]) if static.max_seqlens is not None else (q.shape[0], nheads, q.shape[1])
    lse_dtype = validate.lse_dtype(numpy.dtype(q.dtype).name)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(stats, lse_dtype))
    call = jax.ffi.ffi_call(static.targets[0], results, vmap_method="sequential")
    return tuple(call(q, k, v, *_operand_list(operands, static), **static.attributes("fwd")))


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

@dataclasses.dataclass
class _Request:
    """What one custom call asks for, from its attributes: the operands' names and the core's arguments."""
    pass_: str
    names: list
    scale: float
    causal: bool
    values: dict
    varlen: bool
    max_seqlens: tuple

    @classmethod
    def of(cls, call, pass_, varlen):
        attrs = call.attrs
        names = ["dout", "q", "k", "v", "out", "lse"] if pass_ == "bwd" else ["q", "k", "v"]
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
        if len(names) != len(call.args):
            raise ValueError(f"the custom call has {len(call.args)} operands, expected {len(names)}: "
                             f"{', '.join(names)}")
        max_seqlens = (int(attrs["max_seqlen_q"]), int(attrs["max_seqlen_k"])) if varlen else None
        return cls(pass_, names, float(attrs["softmax_scale"]), bool(attrs["causal"]), values, varlen, max_seqlens)

    def run(self, args, read_seed):
        """The core's results for the operands `args` (NumPy or CuPy arrays, in self.names order);
        read_seed(array) gives the seed operand's two words on the host."""
        arrays = dict(zip(self.names, args))
        given = dict(self.values)
        for option in options.for_call(self.pass_, self.varlen):
            if option.kind == "array":
                given[option.name] = arrays.get(option.name)
            elif option.kind == "seed" and option.name in arrays:
                low, high = (int(word) for word in read_seed(arrays[option.name]))
                given[option.name] = low | high << 32
        leading = [arrays[n] for n in (("dout", "q", "k", "v", "out", "lse") if self.pass_ == "bwd" else ("q", "k", "v"))]
        if self.varlen:
            leading += [arrays["cu_seqlens_q"], arrays["cu_seqlens_k"], *self.max_seqlens]
        if self.pass_ == "fwd":
            function = api.flash_attn_varlen_func if self.varlen else api.flash_attn_func
            return function(*leading, self.scale, self.causal, return_lse=True, **given)
        if self.varlen:
            return api.flash_attn_varlen_backward(*leading, self.scale, self.causal, **given)
        gradients = [o.name for o in options.OPTIONS if o.gradient and o.name in arrays]
        grads = api.flash_attn_backward(*leading, self.scale, self.causal, return_dbias=bool(gradients), **given)
        return grads if gradients else grads[:3]  # (dq, dk, dv) and dbias with a bias: the custom call's results


def _cpu_handler(pass_, varlen):
    def handler(call):
        request = _Request.of(call, pass_, varlen)
        results = request.run([a.numpy() for a in call.args], read_seed=lambda seed: seed)
        for ret, result in zip(call.rets, results, strict=True):
            numpy.copyto(ret.numpy(), result)
    return handler


def _cuda_handler(pass_, varlen):
    """Runs the kernels on XLA's device and stream, then copies the results into XLA's result
    buffers on that stream.

    The copy is one extra device-to-device pass over out (and dq, dk, dv): the core allocates its
    results itself; an out= parameter in the core would let the kernels write XLA's buffers."""
    def handler(call):
        import cupy
        request = _Request.of(call, pass_, varlen)
        device_id, stream_ptr = call.device_ordinal(), call.cuda_stream()
        with cupy.cuda.Device(device_id), _external_stream(cupy, stream_ptr, device_id):
            # cupy.asnumpy copies on the current stream, XLA's: the seed is read once it is written.
            results = request.run([a.cupy(device_id) for a in call.args], read_seed=cupy.asnumpy)
            for ret, result in zip(call.rets, results, strict=True):
                ret.copy_from_cupy(cupy.ascontiguousarray(result), stream_ptr)
    return handler


class _StreamHandle:
    """The CUDA stream protocol (`__cuda_stream__`) for a raw CUstream."""
    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr


def _external_stream(cupy, ptr, device_id):
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14 deprecates ExternalStream
        return cupy.cuda.Stream.from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device_id)


def _register():
    targets = {(_FORWARD, "fwd", False), (_BACKWARD, "bwd", False), (_VARLEN_FORWARD, "fwd", True),
               (_VARLEN_BACKWARD, "bwd", True)}
    for name, pass_, varlen in sorted(targets):
        for platform, make in (("cpu", _cpu_handler), ("CUDA", _cuda_handler)):
            jax.ffi.register_ffi_target(name, _xla_ffi.handler_capsule(make(pass_, varlen)), platform=platform)


_register()  # once per process: the module is imported once
