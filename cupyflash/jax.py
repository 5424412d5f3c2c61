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

Options (the core's; see cupyflash.flash_attn_func): window_size, softcap, softmax_scale, causal,
dropout_p and deterministic are static (Python values, part of the trace); alibi_slopes, attn_bias,
dropout_seed and the varlen cu_seqlens are operands (traced arrays). attn_bias gets a gradient
(dbias), alibi_slopes a zero one.

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

from . import _arrays, _xla_ffi, interface, reference
from .interface import flash_attn_backward, flash_attn_func, flash_attn_varlen_backward, flash_attn_varlen_func

__all__ = ["flash_attn", "flash_attn_varlen", "forward_with_lse", "varlen_forward_with_lse"]

_FORWARD, _BACKWARD = "cupyflash_flash_attn_fwd", "cupyflash_flash_attn_bwd"
_VARLEN_FORWARD, _VARLEN_BACKWARD = "cupyflash_flash_attn_varlen_fwd", "cupyflash_flash_attn_varlen_bwd"

# The operands that follow q, k, v (after dout, q, k, v, out, lse in a backward), in this order,
# those a call has: the varlen packing, then the options' arrays.
_OPERANDS = ("cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "attn_bias", "seed")


def flash_attn(q, k, v, softmax_scale=None, causal=False, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
               attn_bias=None, dropout_p=0.0, dropout_seed=None, deterministic=False):
    """softmax(q k^T * softmax_scale) v for JAX arrays, differentiable in q, k, v and attn_bias.

    q is (batch, seqlen_q, nheads, headdim), k and v are (batch, seqlen_k, nheads_k, headdim),
    as in flash_attn's flash_attn_func; softmax_scale defaults to headdim ** -0.5; causal masking
    is aligned bottom-right (query i sees key j iff j <= i + seqlen_k - seqlen_q). On the GPU,
    q, k and v must be float16 or bfloat16; on the CPU any float type runs the NumPy reference.

    Static (Python values under jit): softmax_scale, causal, window_size (left, right), softcap,
    dropout_p, deterministic (the backward adds dq in a fixed order: bitwise repeatable).
    Arrays: alibi_slopes, float32 (nheads,) or (batch, nheads) (no gradient: its cotangent is 0);
    attn_bias, an additive score bias broadcastable from (batch or 1, nheads or 1, seqlen_q,
    seqlen_k), float32 or q's dtype, whose gradient is computed in every backward (pass it only
    where it is wanted, or wrap it in jax.lax.stop_gradient and accept the cost).
    dropout_seed, needed when dropout_p > 0: the Philox key of the dropout mask (the backward uses
    the same), either a uint32 array of shape (2,) (low word, high word; e.g.
    jax.random.bits(key, (2,), jnp.uint32)): a traced operand, so a new seed each step does not
    retrace; or a Python int in [0, 2**64), which becomes a constant of the program. See the module
    docstring for how the seed reaches the kernels.
    """
    static, operands = _prepare(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias,
                                dropout_p, dropout_seed, deterministic)
    return _flash_attn(q, k, v, operands, static)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                      causal=False, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                      dropout_seed=None, deterministic=False):
    """flash_attn over sequences of different lengths packed without padding, differentiable in q, k, v.

    q is (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim); sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v.
    cu_seqlens_q and cu_seqlens_k are int32 arrays of length batch + 1 (operands: they may change
    without a retrace; the handler checks their values on the host when the call runs);
    max_seqlen_q and max_seqlen_k are static ints at least every length. Options as in flash_attn
    (alibi_slopes (nheads,) or (batch, nheads); no attn_bias); masks and ALiBi are per sequence.
    """
    static, operands = _prepare(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, None, dropout_p,
                                dropout_seed, deterministic, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return _flash_attn(q, k, v, operands, static)


def forward_with_lse(q, k, v, softmax_scale=None, causal=False, **options):
    """(out, lse) of the forward custom call, not differentiable: lse is (batch, nheads, seqlen_q)
    float32. Options as in flash_attn (deterministic aside). For tests and for callers that merge
    partial attention results."""
    static, operands = _prepare(q, k, v, softmax_scale, causal, **_option_arguments(options))
    return _forward(q, k, v, operands, static)


def varlen_forward_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                            causal=False, **options):
    """(out, lse) of flash_attn_varlen's forward, not differentiable: lse is (nheads, total_q) float32."""
    static, operands = _prepare(q, k, v, softmax_scale, causal, **_option_arguments(options),
                                varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return _forward(q, k, v, operands, static)


def _option_arguments(options):
    allowed = ("window_size", "softcap", "alibi_slopes", "attn_bias", "dropout_p", "dropout_seed", "deterministic")
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"unexpected keyword arguments {unknown}; options are {', '.join(allowed)}")
    defaults = dict(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_bias=None, dropout_p=0.0,
                    dropout_seed=None, deterministic=False)
    return dict(defaults, **options)


@dataclasses.dataclass(frozen=True)
class _Static:
    """The static part of a call (a nondiff argument of the custom_vjp)."""
    softmax_scale: float
    causal: bool
    window_size: tuple
    softcap: float
    dropout_p: float
    deterministic: bool
    operands: tuple            # names of the operands after q, k, v, in _OPERANDS order
    max_seqlens: tuple = None  # (max_seqlen_q, max_seqlen_k) for varlen

    def attributes(self, pass_):
        """The typed FFI attributes: a float64 scale keeps it exact, a bool arrives as PRED. Options
        that are off are left out (the handlers read them as off), so that a call without options
        is the custom call it always was."""
        attrs = {"softmax_scale": numpy.float64(self.softmax_scale), "causal": numpy.bool_(self.causal)}
        if self.window_size != (-1, -1):
            attrs.update(window_left=numpy.int64(self.window_size[0]), window_right=numpy.int64(self.window_size[1]))
        if self.softcap:
            attrs["softcap"] = numpy.float64(self.softcap)
        if self.dropout_p:
            attrs["dropout_p"] = numpy.float64(self.dropout_p)
        for name in ("alibi_slopes", "attn_bias"):
            if name in self.operands:
                attrs[f"has_{name}"] = numpy.bool_(True)
        if self.max_seqlens is not None:
            attrs.update(max_seqlen_q=numpy.int64(self.max_seqlens[0]), max_seqlen_k=numpy.int64(self.max_seqlens[1]))
        if pass_ == "bwd" and self.deterministic:
            attrs["deterministic"] = numpy.bool_(True)
        return attrs

    @property
    def targets(self):
        return (_FORWARD, _BACKWARD) if self.max_seqlens is None else (_VARLEN_FORWARD, _VARLEN_BACKWARD)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_attn(q, k, v, operands, static):
    return _forward(q, k, v, operands, static)[0]


def _flash_attn_fwd(q, k, v, operands, static):
    out, lse = _forward(q, k, v, operands, static)
    return out, (q, k, v, operands, out, lse)


def _flash_attn_bwd(static, residuals, dout):
    q, k, v, operands, out, lse = residuals
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if "attn_bias" in operands:
        results.append(jax.ShapeDtypeStruct(operands["attn_bias"].shape, operands["attn_bias"].dtype))
    call = jax.ffi.ffi_call(static.targets[1], results, vmap_method="sequential")
    grads = call(dout.astype(q.dtype), q, k, v, out, lse, *_operand_list(operands, static),
                 **static.attributes("bwd"))
    # Cotangents of the operands: dbias for attn_bias; none (zero) for the slopes, the seed and the packing.
    return (*grads[:3], {name: grads[3] if name == "attn_bias" else None for name in operands})


_flash_attn.defvjp(_flash_attn_fwd, _flash_attn_bwd)


def _forward(q, k, v, operands, static):
    nheads = q.shape[-2]
    stats = (nheads, q.shape[0]) if static.max_seqlens is not None else (q.shape[0], nheads, q.shape[1])
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(stats, jnp.float32))
    call = jax.ffi.ffi_call(static.targets[0], results, vmap_method="sequential")
    return tuple(call(q, k, v, *_operand_list(operands, static), **static.attributes("fwd")))


def _operand_list(operands, static):
    return [operands[name] for name in static.operands]


# --------------------------------------------------------------------------------------------
# Checks at trace time (shapes and dtypes are known then); the core repeats them at run time.

def _prepare(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, attn_bias, dropout_p, dropout_seed,
             deterministic, varlen=None):
    """(_Static, operands by name) of a call, after the core's own argument checks. The NumPy
    caller's rules apply at trace time (any float dtype: CPU arrays run the reference); on the GPU
    the core refuses what its kernels cannot take when the custom call runs. Values of traced
    arrays (cu_seqlens, the seed) are checked when the call runs."""
    caller = _arrays.Caller("numpy", -1)
    operands, packing = {}, None
    if varlen is not None:
        packing = _check_packing(q, k, *varlen)
        operands.update(cu_seqlens_q=varlen[0], cu_seqlens_k=varlen[1])
    shape = interface._check_qkv(q, k, v, caller, packing)
    scale = interface._check_scale(softmax_scale, shape.headdim)
    causal = interface._check_flag("causal", causal)
    arrays = {"q": q}
    for name, value in (("alibi_slopes", alibi_slopes), ("attn_bias", attn_bias)):
        if value is not None:
            arrays[name] = operands[name] = _array(name, value)
    window = reference.window_bounds(False, window_size)  # causal is its own attribute
    opts = interface._check_options(shape, caller, causal, dict(
        window_size=window, softcap=softcap, dropout_p=dropout_p, seed=0, deterministic=deterministic), arrays)
    if opts.dropout_p:
        operands["seed"] = _seed_operand(dropout_seed)
    static = _Static(scale, causal, window, opts.softcap, opts.dropout_p, opts.deterministic,
                     tuple(name for name in _OPERANDS if name in operands),
                     None if packing is None else (packing.max_seqlen_q, packing.max_seqlen_k))
    return static, operands


def _array(name, value):
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(value).__name__}")
    return value


def _check_packing(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The core's _Varlen of a varlen call, from what is known at trace time: cu_seqlens' shapes and
    dtypes and the static max_seqlen."""
    for side, cu, packed in (("q", cu_seqlens_q, q), ("k", cu_seqlens_k, k)):
        _array(f"cu_seqlens_{side}", cu)
        if numpy.dtype(cu.dtype) != numpy.int32:
            raise TypeError(f"cu_seqlens_{side} must have dtype int32, got {cu.dtype}")
        if len(cu.shape) != 1 or cu.shape[0] < 1:
            raise ValueError(f"cu_seqlens_{side} must be 1-D (batch + 1,), got shape {tuple(cu.shape)}")
        if len(getattr(packed, "shape", ())) != 3:
            raise ValueError(f"{side} must be 3-D (total, nheads, headdim) for varlen, got shape "
                             f"{tuple(getattr(packed, 'shape', ()))}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for side, value in (("q", max_seqlen_q), ("k", max_seqlen_k)):
        if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"max_seqlen_{side} must be a static int >= 0 (the longest sequence), got {value!r}")
    return interface._Varlen(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))


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
    options: dict
    max_seqlens: tuple

    @classmethod
    def of(cls, call, pass_, varlen):
        attrs = call.attrs
        scale, causal = attrs["softmax_scale"], bool(attrs["causal"])
        names = ["dout", "q", "k", "v", "out", "lse"] if pass_ == "bwd" else ["q", "k", "v"]
        if varlen:
            names += ["cu_seqlens_q", "cu_seqlens_k"]
        names += [name for name in ("alibi_slopes", "attn_bias") if attrs.get(f"has_{name}")]
        options = dict(window_size=(int(attrs.get("window_left", -1)), int(attrs.get("window_right", -1))),
                       softcap=attrs.get("softcap", 0.0), dropout_p=attrs.get("dropout_p", 0.0))
        if options["dropout_p"]:
            names.append("seed")
        if pass_ == "bwd":
            options["deterministic"] = bool(attrs.get("deterministic", False))
        if len(names) != len(call.args):
            raise ValueError(f"the custom call has {len(call.args)} operands, expected {len(names)}: "
                             f"{', '.join(names)}")
        max_seqlens = (int(attrs["max_seqlen_q"]), int(attrs["max_seqlen_k"])) if varlen else None
        return cls(pass_, names, scale, causal, options, max_seqlens)

    def run(self, args, read_seed):
        """The core's results for the operands `args` (NumPy or CuPy arrays, in self.names order);
        read_seed(array) gives the seed operand's two words on the host."""
        arrays = dict(zip(self.names, args))
        options = dict(self.options, alibi_slopes=arrays.get("alibi_slopes"))
        if "seed" in arrays:
            low, high = (int(word) for word in read_seed(arrays["seed"]))
            options["seed"] = low | high << 32
        q, k, v = arrays["q"], arrays["k"], arrays["v"]
        if self.max_seqlens is not None:
            packing = (arrays["cu_seqlens_q"], arrays["cu_seqlens_k"], *self.max_seqlens)
            if self.pass_ == "fwd":
                return flash_attn_varlen_func(q, k, v, *packing, self.scale, self.causal, return_lse=True, **options)
            return flash_attn_varlen_backward(*(arrays[n] for n in ("dout", "q", "k", "v", "out", "lse")), *packing,
                                              self.scale, self.causal, **options)
        bias = arrays.get("attn_bias")
        if self.pass_ == "fwd":
            return flash_attn_func(q, k, v, self.scale, self.causal, attn_bias=bias, return_lse=True, **options)
        grads = flash_attn_backward(*(arrays[n] for n in ("dout", "q", "k", "v", "out", "lse")), self.scale,
                                    self.causal, attn_bias=bias, return_dbias=bias is not None, **options)
        return grads  # (dq, dk, dv) and dbias with a bias: the custom call's results


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
