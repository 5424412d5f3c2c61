"""FlashAttention for JAX: `flash_attn` is a jax.custom_vjp function that works eagerly, under
jax.jit and under jax.grad.

Forward and backward are XLA custom calls through XLA's typed FFI (see _xla_ffi.py): inside a
jitted program XLA hands the handler its buffers and its CUDA stream, and the handler runs
cupyflash's kernels on that stream, writing into XLA's result buffers; nothing goes through the
host. On XLA's CPU backend the same targets run the NumPy float64 reference, so jit, grad and the
FFI plumbing are testable without a GPU (and float32/float64 inputs work there).

    import jax, jax.numpy as jnp
    from cupyflash.jax import flash_attn
    out = jax.jit(flash_attn, static_argnames="causal")(q, k, v, causal=True)

GPU memory: the kernels' outputs and the backward's scratch come from CuPy's memory pool, beside
XLA's own; XLA takes 75% of the GPU at start unless XLA_PYTHON_CLIENT_PREALLOCATE=false (or a
smaller XLA_PYTHON_CLIENT_MEM_FRACTION) leaves CuPy more.

Not yet: variable-length (varlen) batches, which the kernels do not support yet.
"""

import functools

import jax
import jax.numpy as jnp
import numpy

from . import _arrays, _xla_ffi, interface
from .interface import flash_attn_backward, flash_attn_func

__all__ = ["flash_attn"]

_FORWARD, _BACKWARD = "cupyflash_flash_attn_fwd", "cupyflash_flash_attn_bwd"


def flash_attn(q, k, v, softmax_scale=None, causal=False):
    """softmax(q k^T * softmax_scale) v for JAX arrays, differentiable in q, k and v.

    q is (batch, seqlen_q, nheads, headdim), k and v are (batch, seqlen_k, nheads_k, headdim),
    as in flash_attn's flash_attn_func; softmax_scale defaults to headdim ** -0.5; causal masking
    is aligned bottom-right (query i sees key j iff j <= i + seqlen_k - seqlen_q). On the GPU,
    q, k and v must be float16 or bfloat16; on the CPU any float type runs the NumPy reference.
    softmax_scale and causal must be static (Python values) under jit.
    """
    return _flash_attn(q, k, v, *_checked(q, k, v, softmax_scale, causal))


def forward_with_lse(q, k, v, softmax_scale=None, causal=False):
    """(out, lse) of the forward custom call, not differentiable: lse is (batch, nheads, seqlen_q)
    float32. For tests and for callers that merge partial attention results."""
    return _forward(q, k, v, *_checked(q, k, v, softmax_scale, causal))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash_attn(q, k, v, scale, causal):
    return _forward(q, k, v, scale, causal)[0]


def _flash_attn_fwd(q, k, v, scale, causal):
    out, lse = _forward(q, k, v, scale, causal)
    return out, (q, k, v, out, lse)


def _flash_attn_bwd(scale, causal, residuals, dout):
    q, k, v, out, lse = residuals
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = jax.ffi.ffi_call(_BACKWARD, results, vmap_method="sequential")
    return tuple(call(dout.astype(q.dtype), q, k, v, out, lse, **_attributes(scale, causal)))


_flash_attn.defvjp(_flash_attn_fwd, _flash_attn_bwd)


def _forward(q, k, v, scale, causal):
    batch, seqlen_q, nheads, _ = q.shape
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, nheads, seqlen_q), jnp.float32))
    return tuple(jax.ffi.ffi_call(_FORWARD, results, vmap_method="sequential")(q, k, v, **_attributes(scale, causal)))


def _attributes(scale, causal):
    # Typed FFI attributes: a float64 scalar keeps the scale exact, a bool arrives as PRED.
    return {"softmax_scale": numpy.float64(scale), "causal": numpy.bool_(causal)}


# --------------------------------------------------------------------------------------------
# Checks at trace time (shapes and dtypes are known then); the core repeats them at run time.

def _checked(q, k, v, softmax_scale, causal):
    """(softmax_scale, causal) as the custom calls take them, after the core's own argument checks.
    The NumPy caller's rules apply at trace time (any float dtype: CPU arrays run the reference);
    on the GPU the core refuses what its kernels cannot take when the custom call runs."""
    shape = interface._check_qkv(q, k, v, _arrays.Caller("numpy", -1))
    return interface._check_scale(softmax_scale, shape.headdim), interface._check_flag("causal", causal)


# --------------------------------------------------------------------------------------------
# The handlers, run by XLA at execution (see _xla_ffi.Call for what they get).

def _options(call):
    return call.attrs["softmax_scale"], bool(call.attrs["causal"])


def _forward_cpu(call):
    q, k, v = (a.numpy() for a in call.args)
    out, lse = flash_attn_func(q, k, v, *_options(call), return_lse=True)
    for ret, result in zip(call.rets, (out, lse)):
        numpy.copyto(ret.numpy(), result)


def _backward_cpu(call):
    dout, q, k, v, out, lse = (a.numpy() for a in call.args)
    grads = flash_attn_backward(dout, q, k, v, out, lse, *_options(call))
    for ret, grad in zip(call.rets, grads):
        numpy.copyto(ret.numpy(), grad)


def _on_xla_stream(function):
    """Runs function(call, cupy views of the args) on XLA's device and stream, then copies the
    results it returns into XLA's result buffers on that stream.

    The copy is one extra device-to-device pass over out (and dq, dk, dv): the core allocates its
    results itself; an out= parameter in the core would let the kernels write XLA's buffers."""
    def run(call):
        import cupy
        device_id, stream_ptr = call.device_ordinal(), call.cuda_stream()
        with cupy.cuda.Device(device_id), _external_stream(cupy, stream_ptr, device_id):
            results = function(call, [a.cupy(device_id) for a in call.args])
            for ret, result in zip(call.rets, results):
                ret.copy_from_cupy(cupy.ascontiguousarray(result), stream_ptr)
    return run


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


@_on_xla_stream
def _forward_cuda(call, args):
    return flash_attn_func(*args, *_options(call), return_lse=True)


@_on_xla_stream
def _backward_cuda(call, args):
    return flash_attn_backward(*args, *_options(call))


def _register():
    for platform, forward, backward in (("cpu", _forward_cpu, _backward_cpu),
                                        ("CUDA", _forward_cuda, _backward_cuda)):
        jax.ffi.register_ffi_target(_FORWARD, _xla_ffi.handler_capsule(forward), platform=platform)
        jax.ffi.register_ffi_target(_BACKWARD, _xla_ffi.handler_capsule(backward), platform=platform)


_register()  # once per process: the module is imported once
