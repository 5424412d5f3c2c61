"""The public functions: argument checks, then the GPU kernels or, for NumPy arrays, the reference.

Names, argument order and layout follow flash_attn's `flash_attn_func`: q is
(batch, seqlen_q, nheads, headdim), k and v are (batch, seqlen_k, nheads_k, headdim).
"""

import functools
import math

import numpy

from . import _arrays, _config, _kernels, _params, reference
from ._compile import load

GPU_DTYPES = ("float16", "bfloat16")
NUMPY_DTYPES = ("float16", "bfloat16", "float32", "float64")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False):
    """Exact attention softmax(q k^T * softmax_scale) v, without materialising the score matrix.

    Returns out, shaped like q, or (out, lse) when return_lse is true; lse is
    (batch, nheads, seqlen_q) float32, the natural-log sum of exp(scores) per query row. A row that
    sees no key (causal with seqlen_q > seqlen_k) gets out = 0 and lse = -inf.
    Causal masking is aligned bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q.
    """
    caller = _caller_of(q=q, k=k, v=v)
    shape = _check_qkv(q, k, v, caller)
    scale = _check_scale(softmax_scale, shape.headdim)
    causal = _check_flag("causal", causal)
    if caller.kind == "numpy":
        out, lse = reference.attention_forward(q, k, v, scale, causal)
        out, lse = out.astype(q.dtype), lse.astype(numpy.float32)
    else:
        out, lse = _forward_gpu(caller, shape, q, k, v, scale, causal)
    return (out, lse) if return_lse else out


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False):
    """Gradients (dq, dk, dv) of flash_attn_func, shaped like q, k, v.

    dout is the gradient of out; out and lse are what the forward returned (return_lse=True).
    """
    caller = _caller_of(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    shape = _check_qkv(q, k, v, caller)
    for name, array in (("dout", dout), ("out", out)):
        _check_like_q(name, array, q, caller)
    _check_lse(lse, shape)
    scale = _check_scale(softmax_scale, shape.headdim)
    causal = _check_flag("causal", causal)
    if caller.kind == "numpy":
        grads = reference.attention_backward(dout, q, k, v, scale, causal)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))
    return _backward_gpu(caller, shape, dout, q, k, v, out, lse, scale, causal)


# --------------------------------------------------------------------------------------------
# Argument checks: every one names the argument and what it received, before any launch.

class _Shape:
    def __init__(self, q, k):
        self.batch, self.seqlen_q, self.nheads, self.headdim = q.shape
        self.seqlen_k, self.nheads_k = k.shape[1], k.shape[2]


def _caller_of(**arrays):
    kinds = {}
    for name, array in arrays.items():
        kind = _arrays.kind_of(array)
        if kind is None:
            raise TypeError(f"{name} must be a CuPy, PyTorch or JAX array (or any DLPack producer) on a "
                            f"CUDA device, or a NumPy array; got {type(array).__module__}.{type(array).__name__}")
        if kind != "numpy" and not _arrays.is_on_gpu(array):
            raise ValueError(f"{name} is a {kind} array on the CPU; pass arrays on a CUDA device "
                             f"(or NumPy arrays to run the NumPy reference)")
        kinds[name] = kind
    first = next(iter(arrays))
    for name, kind in kinds.items():
        if kind != kinds[first]:
            raise TypeError(f"{name} is a {kind} array but {first} is a {kinds[first]} array; "
                            f"pass arrays of one kind")
    kind = kinds[first]
    if kind == "numpy":
        return _arrays.Caller("numpy", -1)
    devices = {name: _arrays.dlpack_device(array)[1] for name, array in arrays.items()}
    for name, device in devices.items():
        if device != devices[first]:
            raise ValueError(f"{name} is on CUDA device {device} but {first} is on CUDA device "
                             f"{devices[first]}; pass arrays on one device")
    return _arrays.Caller(kind, devices[first])


def _check_qkv(q, k, v, caller):
    for name, array in (("q", q), ("k", k), ("v", v)):
        if len(array.shape) != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, nheads, headdim), got shape {tuple(array.shape)}")
        if 0 in tuple(array.shape):
            raise ValueError(f"{name} has an empty dimension: shape {tuple(array.shape)}")
    allowed = NUMPY_DTYPES if caller.kind == "numpy" else GPU_DTYPES
    dtype = _arrays.dtype_name(q)
    if dtype not in allowed:
        raise TypeError(f"q must have dtype {' or '.join(allowed)}, got {dtype}")
    for name, array in (("k", k), ("v", v)):
        if _arrays.dtype_name(array) != dtype:
            raise TypeError(f"{name} has dtype {_arrays.dtype_name(array)} but q has dtype {dtype}")
    shape = _Shape(q, k)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != shape.batch:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {shape.batch}")
    if k.shape[3] != shape.headdim:
        raise ValueError(f"k has head dim {k.shape[3]} but q has head dim {shape.headdim}")
    if shape.nheads % shape.nheads_k:
        raise ValueError(f"q's nheads ({shape.nheads}) must be a multiple of k's nheads ({shape.nheads_k})")
    if shape.headdim % 8 or shape.headdim > _config.MAX_HEADDIM:
        raise ValueError(f"head dim must be a multiple of 8 and at most {_config.MAX_HEADDIM}, "
                         f"got {shape.headdim}")
    if caller.kind != "numpy":
        for name, array in (("q", q), ("k", k), ("v", v)):
            _check_last_dim_contiguous(name, array)
        if shape.batch > 65535 or shape.nheads > 65535:
            raise ValueError(f"batch and nheads must be at most 65535 (grid limits), got "
                             f"batch {shape.batch}, nheads {shape.nheads}")
    return shape


def _check_like_q(name, array, q, caller):
    if tuple(array.shape) != tuple(q.shape):
        raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(array.shape)}")
    if _arrays.dtype_name(array) != _arrays.dtype_name(q):
        raise TypeError(f"{name} has dtype {_arrays.dtype_name(array)} but q has dtype {_arrays.dtype_name(q)}")
    if caller.kind != "numpy":
        _check_last_dim_contiguous(name, array)


def _check_lse(lse, shape):
    expected = (shape.batch, shape.nheads, shape.seqlen_q)
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse must have shape (batch, nheads, seqlen_q) = {expected}, got {tuple(lse.shape)}")
    if _arrays.dtype_name(lse) != "float32":
        raise TypeError(f"lse must have dtype float32, got {_arrays.dtype_name(lse)}")


def _element_strides(array):
    """Strides in elements, for any array kind."""
    if isinstance(array, numpy.ndarray) or _arrays.kind_of(array) == "cupy":
        return tuple(s // array.itemsize for s in array.strides)
    if _arrays.kind_of(array) == "torch":
        return tuple(array.stride())
    return None  # JAX and other producers: checked after the DLPack import


def _check_last_dim_contiguous(name, array):
    strides = _element_strides(array)
    if strides is not None and array.shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (headdim), got strides {strides} "
                         f"(in elements)")


def _check_scale(softmax_scale, headdim):
    if softmax_scale is None:
        return headdim ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, numpy.number)):
        raise TypeError(f"softmax_scale must be a positive number or None, got {softmax_scale!r}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be finite and positive, got {softmax_scale!r}")
    return scale


def _check_flag(name, value):
    if not isinstance(value, (bool, numpy.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


# --------------------------------------------------------------------------------------------
# GPU path: import through DLPack, make the parameter block, launch.

@functools.cache
def _device_info(device_id):
    import cupy
    device = cupy.cuda.Device(device_id)
    cc = device.compute_capability
    return device, (int(cc[:-1]), int(cc[-1])), device.attributes["MaxSharedMemoryPerBlockOptin"]


def _tile(pass_, headdim, device_id):
    _, cc, smem_limit = _device_info(device_id)
    return _config.tile_for(pass_, headdim, cc, smem_limit)


def _import(caller, name, array):
    """A CuPy view of a GPU input whose layout the kernels accept (16-byte aligned rows).

    A view that is not (odd element offset or strides) is copied once, which keeps it correct."""
    view = caller.to_cupy(array)
    _check_last_dim_contiguous(name, view)  # JAX and other producers show their strides only now
    aligned = view.data.ptr % 16 == 0 and all(s % 16 == 0 for s in view.strides[:-1])
    return view if aligned else view.copy()  # a fresh allocation is aligned


_STRIDED = ("q", "k", "v", "out", "dout", "dq", "dk", "dv")  # the (batch, seqlen, heads, headdim) tensors


def _strides(prefix, array):
    """FlashParams stride fields of a (batch, seqlen, heads, headdim) array, in elements."""
    batch, row, head, _ = (s // array.itemsize for s in array.strides)
    return {f"{prefix}_batch_stride": batch, f"{prefix}_row_stride": row, f"{prefix}_head_stride": head}


def _common_params(shape, tile, scale, **arrays):
    fields = dict(batch=shape.batch, nheads=shape.nheads, nheads_k=shape.nheads_k, seqlen_q=shape.seqlen_q,
                  seqlen_k=shape.seqlen_k, headdim=shape.headdim, headdim_padded=tile.headdim,
                  softmax_scale=scale, scale_log2=scale * math.log2(math.e))
    for name, array in arrays.items():
        fields[name] = array.data.ptr
        if name in _STRIDED:
            fields.update(_strides(name, array))
    return _params.make_params(**fields)


def _launch(kernel, device, grid, params):
    function = load(kernel, device)
    function(grid, (kernel.threads,), (params,), shared_mem=kernel.smem_bytes)


def _forward_gpu(caller, shape, q, k, v, scale, causal):
    with caller.on_stream():
        q_, k_, v_ = (_import(caller, n, a) for n, a in (("q", q), ("k", k), ("v", v)))
        device = _device_info(caller.device_id)[0]
        tile = _tile("fwd", shape.headdim, caller.device_id)
        out, out_ = caller.empty(q_.shape, q_.dtype)
        lse, lse_ = caller.empty((shape.batch, shape.nheads, shape.seqlen_q), numpy.float32)
        params = _common_params(shape, tile, scale, q=q_, k=k_, v=v_, out=out_, lse=lse_)
        kernel = _kernels.Kernel("fwd", str(q_.dtype), tile, causal, shape.headdim == tile.headdim)
        grid = (-(-shape.seqlen_q // tile.block_m), shape.nheads, shape.batch)
        _launch(kernel, device, grid, params)
        return caller.give_back(out), caller.give_back(lse)


def _backward_gpu(caller, shape, dout, q, k, v, out, lse, scale, causal):
    import cupy
    with caller.on_stream():
        names = ("dout", "q", "k", "v", "out")
        dout_, q_, k_, v_, out_ = (_import(caller, n, a) for n, a in zip(names, (dout, q, k, v, out)))
        lse_ = cupy.ascontiguousarray(caller.to_cupy(lse))
        device = _device_info(caller.device_id)[0]
        tile = _tile("bwd", shape.headdim, caller.device_id)
        dtype = str(q_.dtype)
        dq, dq_ = caller.empty(q_.shape, q_.dtype)
        dk, dk_ = caller.empty(k_.shape, k_.dtype)
        dv, dv_ = caller.empty(v_.shape, v_.dtype)
        dout_dot_out = cupy.empty((shape.batch, shape.nheads, shape.seqlen_q), numpy.float32)
        dq_accum = cupy.zeros((shape.batch, shape.nheads, shape.seqlen_q, tile.headdim), numpy.float32)
        params = _common_params(shape, tile, scale, q=q_, k=k_, v=v_, out=out_, lse=lse_, dout=dout_,
                                dq=dq_, dk=dk_, dv=dv_, dq_accum=dq_accum, dout_dot_out=dout_dot_out)
        row_grid = (-(-shape.seqlen_q // _kernels.ROWS_PER_ROW_KERNEL_BLOCK), shape.nheads, shape.batch)
        _launch(_kernels.Kernel("bwd_dot", dtype), device, row_grid, params)
        kernel = _kernels.Kernel("bwd", dtype, tile, causal, shape.headdim == tile.headdim)
        _launch(kernel, device, (-(-shape.seqlen_k // tile.block_n), shape.nheads_k, shape.batch), params)
        _launch(_kernels.Kernel("bwd_convert_dq", dtype), device, row_grid, params)
        return caller.give_back(dq), caller.give_back(dk), caller.give_back(dv)
