"""The public functions: argument checks, then the GPU kernels or, for NumPy arrays, the reference.

Names, argument order and layout follow flash_attn's `flash_attn_func`: q is
(batch, seqlen_q, nheads, headdim), k and v are (batch, seqlen_k, nheads_k, headdim).
"""

import dataclasses
import functools
import math
import os
import threading

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
    inputs = (q, k, v)
    key = _plan_key("fwd", inputs, softmax_scale, causal)
    plan = _plans.get(key)
    result = plan.run(inputs) if plan is not None else None
    if result is None:
        caller = _caller_of(q=q, k=k, v=v)
        shape = _check_qkv(q, k, v, caller)
        scale = _check_scale(softmax_scale, shape.headdim)
        causal = _check_flag("causal", causal)
        if caller.kind == "numpy":
            out, lse = reference.attention_forward(q, k, v, scale, causal)
            result = out.astype(q.dtype), lse.astype(numpy.float32)
        else:
            inputs, copied = _launchable(caller, dict(q=q, k=k, v=v))
            plan = _forward_plan(caller, shape, scale, causal, *inputs)
            _remember(key, plan, copied)
            result = plan.run(inputs)
    return result if return_lse else result[0]


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False):
    """Gradients (dq, dk, dv) of flash_attn_func, shaped like q, k, v.

    dout is the gradient of out; out and lse are what the forward returned (return_lse=True).
    """
    inputs = (dout, q, k, v, out, lse)
    key = _plan_key("bwd", inputs, softmax_scale, causal)
    plan = _plans.get(key)
    result = plan.run(inputs) if plan is not None else None
    if result is None:
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
        inputs, copied = _launchable(caller, dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse))
        plan = _backward_plan(caller, shape, scale, causal, *inputs)
        _remember(key, plan, copied)
        result = plan.run(inputs)
    return result


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
# GPU path. Everything about a launch except the data pointers (kernels, grids, the parameter
# block's sizes and strides) follows from the arrays' kinds, shapes, strides, dtypes and device
# and from the options, all of which the argument checks have passed for. So a call's launch plan
# is cached under exactly those: a repeated call costs its output allocations, one pointer patch
# and the launches (at seqlen 1k a kernel runs for tens of microseconds, so the host must not).

@functools.cache
def _device_info(device_id):
    import cupy
    device = cupy.cuda.Device(device_id)
    cc = device.compute_capability
    return device, (int(cc[:-1]), int(cc[-1])), device.attributes["MaxSharedMemoryPerBlockOptin"]


def _tile(pass_, headdim, device_id):
    _, cc, smem_limit = _device_info(device_id)
    return _config.tile_for(pass_, headdim, cc, smem_limit)


_plans = {}
_MAX_PLANS = 4096  # shapes seen by one process; past this the cache starts afresh


def _plan_key(pass_, arrays, softmax_scale, causal):
    """The cache key of a call, or None for arrays that are not torch tensors or CuPy arrays.
    Option types are part of it, so that a call with causal=1 still meets the bool check, and so
    is a forced tile table, which picks other kernels for the same arrays."""
    key = [pass_, type(softmax_scale), softmax_scale, type(causal), causal, os.environ.get("CUPYFLASH_TILES")]
    for array in arrays:
        kind = _arrays.kind_of_type(type(array))
        if kind == "torch":
            key += (array.shape, array.stride(), array.dtype, array.device)
        elif kind == "cupy":
            key += (array.shape, array.strides, array.dtype, array.device.id)
        else:
            return None
        key.append(type(array))
    return tuple(key)


def _remember(key, plan, copied):
    """Caches a plan, unless some input had to be copied (its strides are not the caller's)."""
    if key is None or copied:
        return
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = plan


def _launchable(caller, arrays):
    """(inputs as the plan takes them, whether any was copied). Views the kernels cannot read
    (rows not 16-byte aligned, or an lse that is not contiguous) are copied once, which keeps
    them correct."""
    result, copied = [], False
    for name, array in arrays.items():
        array = caller.launchable(array)
        strides = _element_strides(array)
        if name == "lse":
            ok = strides == _contiguous_strides(array.shape)
        else:
            _check_last_dim_contiguous(name, array)  # JAX and other producers show their strides only now
            ok = caller.data_pointer(array) % 16 == 0 and all(s * 2 % 16 == 0 for s in strides[:-1])
        if not ok:
            copied = True
            if caller.kind == "torch":
                import torch
                array = array.clone(memory_format=torch.contiguous_format)  # a fresh allocation is aligned
            else:
                array = array.copy()
        result.append(array)
    return tuple(result), copied


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@dataclasses.dataclass(frozen=True)
class _Launch:
    kernel: _kernels.Kernel
    grid: tuple


class _Plan:
    """The launches of one call signature, with the parameter block ready but for its pointers.

    `run(inputs)` allocates the outputs, writes the inputs' and outputs' addresses into the
    block and launches every kernel on the caller's stream; it returns the outputs that are
    results, or None when an input's address is not aligned as the kernels need (then the
    caller's slow path copies it)."""

    def __init__(self, caller, params, inputs, outputs, results, launches):
        self.caller = caller
        self.outputs = outputs      # [(name, shape, dtype)], allocated on every call
        self.results = results      # indices into outputs of what the call returns
        self.kernels = [l.kernel for l in launches]
        with caller.device():  # a kernel's CUfunction belongs to the device current when it is loaded
            self.launches = [(load(l.kernel, caller.device()).kernel.ptr, l.grid, l.kernel.threads,
                              l.kernel.smem_bytes) for l in launches]  # (CUfunction, grid, threads, smem)
        self.words = params.view(numpy.uint64)
        self.slots = numpy.array([params.dtype.fields[name][1] // 8 for name in (*inputs, *(o[0] for o in outputs))])
        self.alignments = [4 if name == "lse" else 16 for name in inputs]  # what the kernels' loads need
        self.argv = numpy.array([self.words.ctypes.data], numpy.uint64)  # the kernels' one argument
        self.argv_address = self.argv.ctypes.data
        self.lock = threading.Lock()

    def run(self, inputs):
        import cupy
        caller = self.caller
        pointers = [caller.data_pointer(a) for a in inputs]
        if any(pointer % alignment for pointer, alignment in zip(pointers, self.alignments)):
            return None
        with caller.device():
            outputs = [caller.empty(shape, dtype) for _, shape, dtype in self.outputs]
            pointers += [caller.data_pointer(a) for a in outputs]
            stream = caller.stream_pointer()
            with self.lock:  # the launch copies the parameter block, so it is free again after it
                self.words[self.slots] = pointers
                for function, grid, threads, smem_bytes in self.launches:
                    cupy.cuda.driver.launchKernel(function, *grid, threads, 1, 1, smem_bytes, stream,
                                                  self.argv_address, 0)
        return tuple(caller.give_back(outputs[i]) for i in self.results)


def _param_block(shape, tile, scale, strides):
    """The FlashParams block without pointers; `strides` maps each (batch, seqlen, heads, headdim)
    tensor of the call (q, k, v, out, dout, dq, dk, dv) to its element strides."""
    fields = dict(batch=shape.batch, nheads=shape.nheads, nheads_k=shape.nheads_k, seqlen_q=shape.seqlen_q,
                  seqlen_k=shape.seqlen_k, headdim=shape.headdim, headdim_padded=tile.headdim,
                  softmax_scale=scale, scale_log2=scale * math.log2(math.e))
    for name, (batch, row, head, _) in strides.items():
        fields.update({f"{name}_batch_stride": batch, f"{name}_row_stride": row, f"{name}_head_stride": head})
    return _params.make_params(**fields)


def _forward_plan(caller, shape, scale, causal, q, k, v):
    tile = _tile("fwd", shape.headdim, caller.device_id)
    dtype = _arrays.dtype_name(q)
    stats = (shape.batch, shape.nheads, shape.seqlen_q)
    strides = dict(q=_element_strides(q), k=_element_strides(k), v=_element_strides(v),
                   out=_contiguous_strides(q.shape))
    kernel = _kernels.Kernel("fwd", dtype, tile, causal, shape.headdim == tile.headdim)
    grid = (-(-shape.seqlen_q // tile.block_m), shape.nheads, shape.batch)
    return _Plan(caller, _param_block(shape, tile, scale, strides), ("q", "k", "v"),
                 [("out", tuple(q.shape), dtype), ("lse", stats, "float32")], (0, 1), [_Launch(kernel, grid)])


def _backward_plan(caller, shape, scale, causal, dout, q, k, v, out, lse):
    tile = _tile("bwd", shape.headdim, caller.device_id)
    dtype = _arrays.dtype_name(q)
    stats = (shape.batch, shape.nheads, shape.seqlen_q)
    strides = dict(dout=_element_strides(dout), q=_element_strides(q), k=_element_strides(k),
                   v=_element_strides(v), out=_element_strides(out), dq=_contiguous_strides(q.shape),
                   dk=_contiguous_strides(k.shape), dv=_contiguous_strides(v.shape))
    outputs = [("dq", tuple(q.shape), dtype), ("dk", tuple(k.shape), dtype), ("dv", tuple(v.shape), dtype),
               ("dout_dot_out", stats, "float32"), ("lse_log2", stats, "float32"),
               ("dq_accum", (*stats, tile.headdim), "float32")]  # zeroed by bwd_dot
    row_grid = (-(-shape.seqlen_q // _kernels.ROWS_PER_ROW_KERNEL_BLOCK), shape.nheads, shape.batch)
    launches = [_Launch(_kernels.Kernel("bwd_dot", dtype), row_grid),
                _Launch(_kernels.Kernel("bwd", dtype, tile, causal, shape.headdim == tile.headdim),
                        (-(-shape.seqlen_k // tile.block_n), shape.nheads_k, shape.batch)),
                _Launch(_kernels.Kernel("bwd_convert_dq", dtype), row_grid)]
    return _Plan(caller, _param_block(shape, tile, scale, strides), ("dout", "q", "k", "v", "out", "lse"),
                 outputs, (0, 1, 2), launches)
