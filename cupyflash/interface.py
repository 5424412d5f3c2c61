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


_OPTIONS_DOC = """
    Options (flash_attn's names and meaning; each default means off, and all combine):
      window_size   (left, right): query i sees keys [i + seqlen_k - seqlen_q - left,
                    i + seqlen_k - seqlen_q + right]; -1 leaves a side unbounded. Blocks outside the
                    window are skipped, not computed.
      softcap       > 0: scores become softcap * tanh(scores / softcap)
      alibi_slopes  float32 (nheads,) or (batch, nheads): head h adds -slope * |i + seqlen_k - seqlen_q - j|
      attn_bias     an additive bias broadcastable from (batch or 1, nheads or 1, seqlen_q, seqlen_k),
                    float32 or q's dtype (not for varlen)
      dropout_p     probability of dropping an attention probability, in [0, 1); needs `seed`
      seed          an int in [0, 2**64): the Philox key of the dropout mask. The backward must get
                    the same seed, and regenerates the mask instead of storing it.
    Order, as in the reference: s = q k^T * scale, then softcap, then + ALiBi + attn_bias, then the mask.
"""


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, *, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, attn_bias=None, dropout_p=0.0, seed=None, return_lse=False):
    """Exact attention softmax(q k^T * softmax_scale) v, without materialising the score matrix.

    q is (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim).
    Returns out, shaped like q, or (out, lse) when return_lse is true; lse is
    (batch, nheads, seqlen_q) float32, the natural-log sum of exp(scores) per query row. A row that
    sees no key (causal with seqlen_q > seqlen_k, or a window past every key) gets out = 0 and lse = -inf.
    Causal masking is aligned bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q.
    """
    options = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias,
                   dropout_p=dropout_p, seed=seed)
    result = _call("fwd", dict(q=q, k=k, v=v), softmax_scale, causal, options)
    return result if return_lse else result[0]


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False, *, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, attn_bias=None, dropout_p=0.0, seed=None,
                        deterministic=False, return_dbias=False):
    """Gradients (dq, dk, dv) of flash_attn_func, shaped like q, k, v; the options must be the forward's.

    dout is the gradient of out; out and lse are what the forward returned (return_lse=True).
    deterministic=True adds dq in a fixed order, so repeated calls give bitwise identical results
    (the default adds with float32 atomics, in whatever order the hardware runs). return_dbias=True
    also returns the gradient of attn_bias, in attn_bias's shape and dtype (None without attn_bias).
    """
    options = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias,
                   dropout_p=dropout_p, seed=seed, deterministic=deterministic, return_dbias=return_dbias)
    return _call("bwd", dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse), softmax_scale, causal, options)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                           seed=None, return_lse=False):
    """flash_attn_func over a batch of sequences of different lengths, packed without padding.

    q is (total_q, nheads, headdim) and k, v (total_k, nheads_k, headdim); sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v
    (int32 arrays of length batch + 1 on q's device; empty sequences are allowed). max_seqlen_* are
    the longest lengths (ints). lse is (nheads, total_q). Masks and ALiBi are per sequence.
    The cu_seqlens are checked on the host, which waits for them to be computed.
    """
    options = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   seed=seed)
    varlen = _Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    result = _call("fwd", dict(q=q, k=k, v=v), softmax_scale, causal, options, varlen)
    return result if return_lse else result[0]


def flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, *, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, dropout_p=0.0, seed=None, deterministic=False):
    """Gradients (dq, dk, dv) of flash_attn_varlen_func, packed like q, k, v."""
    options = dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   seed=seed, deterministic=deterministic)
    varlen = _Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _call("bwd", dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse), softmax_scale, causal, options, varlen)


for _function in (flash_attn_func, flash_attn_backward, flash_attn_varlen_func, flash_attn_varlen_backward):
    _function.__doc__ += _OPTIONS_DOC


# Packed forms: views into one array, no copies (JAX has no views; there indexing copies).

def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, **options):
    """flash_attn_func with q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]; qkv is (batch, seqlen, 3, nheads, headdim)."""
    _check_packed("qkv", qkv, 5, 3)
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale, causal, **options)


def flash_attn_kvpacked_func(q, kv, softmax_scale=None, causal=False, **options):
    """flash_attn_func with k, v = kv[:, :, 0], kv[:, :, 1]; kv is (batch, seqlen_k, 2, nheads_k, headdim)."""
    _check_packed("kv", kv, 5, 2)
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], softmax_scale, causal, **options)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, softmax_scale=None, causal=False, **options):
    """flash_attn_varlen_func with q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]; qkv is (total, 3, nheads, headdim)."""
    _check_packed("qkv", qkv, 4, 3)
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  softmax_scale, causal, **options)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    softmax_scale=None, causal=False, **options):
    """flash_attn_varlen_func with k, v = kv[:, 0], kv[:, 1]; kv is (total_k, 2, nheads_k, headdim)."""
    _check_packed("kv", kv, 4, 2)
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal, **options)


def _check_packed(name, array, ndim, count):
    shape = tuple(getattr(array, "shape", ()))
    if len(shape) != ndim or shape[ndim - 3] != count:
        where = "(batch, seqlen, " if ndim == 5 else "(total, "
        raise ValueError(f"{name} must be {ndim}-D {where}{count}, nheads, headdim), got shape {shape}")


class _Varlen:
    """The packing arguments of a varlen call."""

    def __init__(self, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        self.max_seqlen_q, self.max_seqlen_k = max_seqlen_q, max_seqlen_k

    @property
    def batch(self):
        """The number of sequences (cu_seqlens_q must have been checked to be 1-D)."""
        return self.cu_seqlens_q.shape[0] - 1


def _call(pass_, arrays, softmax_scale, causal, options, varlen=None):
    """One public call: the cached plan of its signature if there is one, else checks and a new plan."""
    if varlen is not None:
        arrays = dict(arrays, cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_k)
    for name in ("alibi_slopes", "attn_bias"):
        if options.get(name) is not None:
            arrays[name] = options[name]
    key = _plan_key(pass_, arrays, softmax_scale, causal, options, varlen)
    plan = _plans.get(key)
    if plan is not None and varlen is not None:
        _check_varlen(varlen, arrays, plan.caller)  # their values change from call to call
    result = plan.run(arrays, options.get("seed")) if plan is not None else None
    if result is not None:
        return result
    caller = _caller_of(**arrays)
    if varlen is not None:
        _check_varlen(varlen, arrays, caller)
    shape = _check_qkv(arrays["q"], arrays["k"], arrays["v"], caller, varlen)
    if pass_ == "bwd":
        for name in ("dout", "out"):
            _check_like_q(name, arrays[name], arrays["q"], caller)
        _check_lse(arrays["lse"], shape)
    scale = _check_scale(softmax_scale, shape.headdim)
    causal = _check_flag("causal", causal)
    opts = _check_options(shape, caller, causal, options, arrays)
    if caller.kind == "numpy":
        return _reference(pass_, arrays, scale, causal, opts, varlen)
    inputs, copied = _launchable(caller, arrays)
    plan = (_forward_plan if pass_ == "fwd" else _backward_plan)(caller, shape, scale, opts, inputs, varlen)
    _remember(key, plan, copied)
    return plan.run(inputs, opts.seed)


def _reference(pass_, arrays, scale, causal, opts, varlen):
    """The NumPy path: the float64 reference, results in the inputs' dtype (lse float32)."""
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    common = dict(window_size=opts.window_size, softcap=opts.softcap, alibi_slopes=opts.alibi_slopes,
                  dropout_p=opts.dropout_p, seed=opts.seed)
    if varlen is None:
        common["attn_bias"] = opts.attn_bias
    if pass_ == "fwd":
        if varlen is None:
            out, lse = reference.attention_forward(q, k, v, scale, causal, **common)
        else:
            out, lse = reference.attention_forward_varlen(q, k, v, arrays["cu_seqlens_q"], arrays["cu_seqlens_k"],
                                                          scale, causal, **common)
        return out.astype(q.dtype), lse.astype(numpy.float32)
    dout = arrays["dout"]
    if varlen is None:
        grads = reference.attention_backward(dout, q, k, v, scale, causal, return_dbias=opts.return_dbias,
                                             **common)
    else:
        grads = reference.attention_backward_varlen(dout, q, k, v, arrays["cu_seqlens_q"], arrays["cu_seqlens_k"],
                                                    scale, causal, **common)
    result = tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))
    if opts.return_dbias:
        dbias = grads[3]
        result += (None if dbias is None else dbias.astype(opts.attn_bias.dtype),)
    return result


# --------------------------------------------------------------------------------------------
# Argument checks: every one names the argument and what it received, before any launch.

class _Shape:
    """Sizes of a call; for varlen, batch counts the sequences and seqlen_* are max_seqlen_*."""

    def __init__(self, q, k, varlen=None):
        self.nheads, self.headdim = q.shape[-2:]
        self.nheads_k = k.shape[-2]
        self.varlen = varlen is not None
        if varlen is None:
            self.batch, self.seqlen_q, self.seqlen_k = q.shape[0], q.shape[1], k.shape[1]
            self.stats = (self.batch, self.nheads, self.seqlen_q)  # lse's shape
        else:
            self.total_q, self.total_k = q.shape[0], k.shape[0]
            self.batch = varlen.batch
            self.seqlen_q, self.seqlen_k = varlen.max_seqlen_q, varlen.max_seqlen_k
            self.stats = (self.nheads, self.total_q)


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


def _check_qkv(q, k, v, caller, varlen=None):
    ndim = 3 if varlen is not None else 4
    layout = "(total, nheads, headdim)" if varlen is not None else "(batch, seqlen, nheads, headdim)"
    for name, array in (("q", q), ("k", k), ("v", v)):
        if len(array.shape) != ndim:
            raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(array.shape)}")
        if 0 in tuple(array.shape)[ndim - 2:] or (varlen is None and 0 in tuple(array.shape)):
            raise ValueError(f"{name} has an empty dimension: shape {tuple(array.shape)}")
    allowed = NUMPY_DTYPES if caller.kind == "numpy" else GPU_DTYPES
    dtype = _arrays.dtype_name(q)
    if dtype not in allowed:
        raise TypeError(f"q must have dtype {' or '.join(allowed)}, got {dtype}")
    for name, array in (("k", k), ("v", v)):
        if _arrays.dtype_name(array) != dtype:
            raise TypeError(f"{name} has dtype {_arrays.dtype_name(array)} but q has dtype {dtype}")
    shape = _Shape(q, k, varlen)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if varlen is None and k.shape[0] != shape.batch:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {shape.batch}")
    if k.shape[-1] != shape.headdim:
        raise ValueError(f"k has head dim {k.shape[-1]} but q has head dim {shape.headdim}")
    if shape.nheads % shape.nheads_k:
        raise ValueError(f"q's nheads ({shape.nheads}) must be a multiple of k's nheads ({shape.nheads_k})")
    if shape.headdim % 8 or shape.headdim > _config.MAX_HEADDIM:
        raise ValueError(f"head dim must be a multiple of 8 and at most {_config.MAX_HEADDIM}, "
                         f"got {shape.headdim}")
    if caller.kind != "numpy":
        for name, array in (("q", q), ("k", k), ("v", v)):
            _check_last_dim_contiguous(name, array)
        if shape.batch > _MAX_GRID_YZ or shape.nheads > _MAX_GRID_YZ:
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
    expected = shape.stats
    if tuple(lse.shape) != expected:
        names = "(nheads, total_q)" if shape.varlen else "(batch, nheads, seqlen_q)"
        raise ValueError(f"lse must have shape {names} = {expected}, got {tuple(lse.shape)}")
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


@dataclasses.dataclass(frozen=True)
class _Options:
    """The checked options of a call."""
    window_size: tuple       # (left, right), causal folded in as right = 0; -1 is unbounded
    softcap: float
    alibi_slopes: object     # array or None
    attn_bias: object        # array or None
    dropout_p: float
    seed: object             # int, or None without dropout
    deterministic: bool
    return_dbias: bool

    @property
    def local(self):
        """Whether rows see a bounded key range (the LOCAL kernels)."""
        return self.window_size != (-1, -1)

    def extras(self, pass_):
        """Whether the pass needs the OPTIONS kernels (cuda_src/common/score.cuh); a deterministic
        backward is one of them (_kernels.Kernel)."""
        return bool(self.softcap or self.alibi_slopes is not None or self.attn_bias is not None
                    or self.dropout_p or (pass_ == "bwd" and self.deterministic))


def _check_options(shape, caller, causal, options, arrays):
    window = reference.window_bounds(causal, options.get("window_size", (-1, -1)))
    softcap = options.get("softcap", 0.0)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, numpy.number)) \
            or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap!r}")
    dropout_p = reference.check_dropout_p(options.get("dropout_p", 0.0))
    seed = reference.check_seed(options.get("seed"), dropout_p) if dropout_p else None  # the Philox key
    deterministic = _check_flag("deterministic", options.get("deterministic", False))
    return_dbias = _check_flag("return_dbias", options.get("return_dbias", False))
    alibi = arrays.get("alibi_slopes")
    if alibi is not None:
        if _arrays.dtype_name(alibi) != "float32":
            raise TypeError(f"alibi_slopes must have dtype float32, got {_arrays.dtype_name(alibi)}")
        if tuple(alibi.shape) not in ((shape.nheads,), (shape.batch, shape.nheads)):
            raise ValueError(f"alibi_slopes must have shape (nheads,) = ({shape.nheads},) or (batch, nheads) = "
                             f"({shape.batch}, {shape.nheads}), got {tuple(alibi.shape)}")
    bias = arrays.get("attn_bias")
    if bias is not None:
        allowed = ("float32", _arrays.dtype_name(arrays["q"]))
        if caller.kind == "numpy":
            allowed = NUMPY_DTYPES
        if _arrays.dtype_name(bias) not in allowed:
            raise TypeError(f"attn_bias must have dtype {' or '.join(sorted(set(allowed)))}, "
                            f"got {_arrays.dtype_name(bias)}")
        full = (shape.batch, shape.nheads, shape.seqlen_q, shape.seqlen_k)
        bias_shape = tuple(bias.shape)
        if not 2 <= len(bias_shape) <= 4 or bias_shape[-2:] != full[2:] or any(
                size not in (1, want) for size, want in zip(bias_shape[-4:-2][::-1], full[1::-1])):
            raise ValueError(f"attn_bias must broadcast from (batch or 1, nheads or 1, seqlen_q, seqlen_k) = "
                             f"{full}, got shape {bias_shape}")
    return _Options(window, float(softcap), alibi, bias, float(dropout_p), seed, deterministic, return_dbias)


def _check_varlen(varlen, arrays, caller):
    """cu_seqlens on the host: int32, non-decreasing from 0 to the packed totals, max_seqlen at least
    every length."""
    lengths = {}
    for side in ("q", "k"):
        cu = arrays[f"cu_seqlens_{side}"]
        if len(getattr(arrays[side], "shape", ())) != 3:
            raise ValueError(f"{side} must be 3-D (total, nheads, headdim) for varlen, got shape "
                             f"{tuple(getattr(arrays[side], 'shape', ()))}")
        if caller.kind != "numpy" and _arrays.dtype_name(cu) != "int32":
            raise TypeError(f"cu_seqlens_{side} must have dtype int32, got {_arrays.dtype_name(cu)}")
        host = _arrays.to_host(cu, caller)
        reference.check_cu_seqlens(f"cu_seqlens_{side}", host, None, arrays[side].shape[0])
        reference.check_max_seqlen(f"max_seqlen_{side}", getattr(varlen, f"max_seqlen_{side}"), host)
        lengths[side] = host
    if len(lengths["q"]) != len(lengths["k"]):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{len(lengths['q'])} and {len(lengths['k'])}")


# --------------------------------------------------------------------------------------------
# GPU path. Everything about a launch except the data pointers (kernels, grids, the parameter
# block's sizes and strides) follows from the arrays' kinds, shapes, strides, dtypes and device
# and from the options, all of which the argument checks have passed for. So a call's launch plan
# is cached under exactly those: a repeated call costs its output allocations, one pointer patch
# and the launches (at seqlen 1k a kernel runs for tens of microseconds, so the host must not).

@functools.cache
def _device_attributes(device_id):
    """The device's attributes (CuPy queries every one of them each time it is asked)."""
    import cupy
    return cupy.cuda.Device(device_id).attributes


@functools.cache
def _device_info(device_id):
    import cupy
    device = cupy.cuda.Device(device_id)
    cc = device.compute_capability
    return device, (int(cc[:-1]), int(cc[-1])), _device_attributes(device_id)["MaxSharedMemoryPerBlockOptin"]


def _tile(pass_, headdim, device_id):
    _, cc, smem_limit = _device_info(device_id)
    return _config.tile_for(pass_, headdim, cc, smem_limit)


_plans = {}
_MAX_PLANS = 4096  # shapes seen by one process; past this the cache starts afresh


_UNBOUNDED = 1 << 30   # a window side with no bound, as cuda_src/common/mask.cuh expects
_MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z dimensions
_TILE_INPUTS = ("q", "k", "v", "out", "dout")  # 16-bit tensors read by 16-byte cp.async


def _hashable(value):
    """value as part of a cache key (lists become tuples); TypeError if it cannot be one."""
    if isinstance(value, list):
        return ("list",) + tuple(_hashable(v) for v in value)
    hash(value)
    return value


def _plan_key(pass_, arrays, softmax_scale, causal, options, varlen):
    """The cache key of a call, or None when some argument cannot be part of one (arrays that are
    not torch tensors or CuPy arrays, unhashable options). Option types are part of it, so that
    a call with causal=1 still meets the bool check, and so is a forced tile table, which picks
    other kernels for the same arrays. The dropout seed's value is not: plans patch it per call."""
    try:
        key = [pass_, os.environ.get("CUPYFLASH_TILES"), type(softmax_scale), _hashable(softmax_scale),
               type(causal), causal]
        for name, value in options.items():
            if name not in ("alibi_slopes", "attn_bias", "seed"):
                key += (name, type(value), _hashable(value))
        key.append(type(options.get("seed")))
        if varlen is not None:
            key += (type(varlen.max_seqlen_q), _hashable(varlen.max_seqlen_q), type(varlen.max_seqlen_k),
                    _hashable(varlen.max_seqlen_k))
    except TypeError:
        return None
    for name, array in arrays.items():
        kind = _arrays.kind_of_type(type(array))
        if kind == "torch":
            key += (name, array.shape, array.stride(), array.dtype, array.device)
        elif kind == "cupy":
            key += (name, array.shape, array.strides, array.dtype, array.device.id)
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


def _alignment(name, array):
    """The byte alignment the kernels need of an input's address."""
    return 16 if name in _TILE_INPUTS else array.element_size() if hasattr(array, "element_size") else array.itemsize


def _launchable(caller, arrays):
    """(inputs as the plan takes them, whether any was copied). Views the kernels cannot read
    (16-bit tensors whose rows are not 16-byte aligned; row statistics and cu_seqlens that are not
    contiguous; alibi_slopes or attn_bias not contiguous in their last dimension) are copied once,
    which keeps them correct."""
    result, copied = {}, False
    for name, array in arrays.items():
        array = caller.launchable(array)
        strides = _element_strides(array)
        aligned = caller.data_pointer(array) % _alignment(name, array) == 0
        if name in _TILE_INPUTS:
            _check_last_dim_contiguous(name, array)  # JAX and other producers show their strides only now
            ok = aligned and all(s * 2 % 16 == 0 for s in strides[:-1])
        elif name in ("lse", "cu_seqlens_q", "cu_seqlens_k"):
            ok = aligned and strides == _contiguous_strides(array.shape)
        else:  # alibi_slopes, attn_bias
            ok = aligned and (array.shape[-1] == 1 or strides[-1] == 1)
        if not ok:
            copied = True
            if caller.kind == "torch":
                import torch
                array = array.clone(memory_format=torch.contiguous_format)  # a fresh allocation is aligned
            else:
                array = array.copy()
        result[name] = array
    return result, copied


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


@dataclasses.dataclass(frozen=True)
class _Output:
    name: str           # its FlashParams field
    shape: tuple
    dtype: str
    zeroed: bool = False


class _Plan:
    """The launches of one call signature, with the parameter block ready but for its pointers.

    `run(arrays, seed)` allocates the outputs, writes the inputs' and outputs' addresses (and the
    dropout seed) into the block, launches every kernel on the caller's stream and returns
    `finish(outputs)`; it returns None when an input's address is not aligned as the kernels need
    (then the caller's slow path copies it)."""

    def __init__(self, caller, params, inputs, outputs, launches, finish):
        self.caller = caller
        self.inputs = [(name, _alignment(name, array)) for name, array in inputs.items()]
        self.outputs = outputs
        self.finish = finish
        self.kernels = [l.kernel for l in launches]
        with caller.device():  # a kernel's CUfunction belongs to the device current when it is loaded
            self.launches = [(load(l.kernel, caller.device()).kernel.ptr, l.grid, l.kernel.threads,
                              l.kernel.smem_bytes) for l in launches if 0 not in l.grid]
        self.words = params.view(numpy.uint64)
        slot = lambda name: params.dtype.fields[name][1] // 8  # noqa: E731
        self.slots = numpy.array([slot(name) for name, _ in self.inputs] + [slot(o.name) for o in outputs])
        self.seed_slot = slot("dropout_seed") if params["dropout_scale"][0] != 0 else None
        self.argv = numpy.array([self.words.ctypes.data], numpy.uint64)  # the kernels' one argument
        self.argv_address = self.argv.ctypes.data
        self.lock = threading.Lock()

    def run(self, arrays, seed):
        import cupy
        caller = self.caller
        pointers = []
        for name, alignment in self.inputs:
            pointer = caller.data_pointer(arrays[name])
            if pointer % alignment:
                return None
            pointers.append(pointer)
        if self.seed_slot is not None and not (isinstance(seed, (int, numpy.integer)) and 0 <= seed < 2 ** 64):
            return None  # the slow path names the bad seed
        with caller.device():
            outputs = {o.name: (caller.zeros if o.zeroed else caller.empty)(o.shape, o.dtype) for o in self.outputs}
            pointers += [caller.data_pointer(a) for a in outputs.values()]
            stream = caller.stream_pointer()
            with self.lock:  # the launch copies the parameter block, so it is free again after it
                self.words[self.slots] = pointers
                if self.seed_slot is not None:
                    self.words[self.seed_slot] = int(seed)
                for function, grid, threads, smem_bytes in self.launches:
                    cupy.cuda.driver.launchKernel(function, *grid, threads, 1, 1, smem_bytes, stream,
                                                  self.argv_address, 0)
            return tuple(None if a is None else caller.give_back(a) for a in self.finish(outputs))


def _tensor_strides(strides, varlen):
    """(batch, row, head) of a q/k/v-like tensor's element strides; packed varlen tensors have no batch stride."""
    return (0, *strides[:2]) if varlen is not None else strides[:3]


def _param_block(shape, tile, scale, strides, opts, inputs, block_major, semaphore_blocks=0):
    """The FlashParams block without pointers; `strides` maps each (batch, seqlen, heads, headdim)
    tensor of the call (q, k, v, out, dout, dq, dk, dv) to its (batch, row, head) element strides."""
    left, right = (_UNBOUNDED if side < 0 else side for side in opts.window_size)
    stats_strides = (0, shape.total_q) if shape.varlen else (shape.nheads * shape.seqlen_q, shape.seqlen_q)
    dq_accum_rows = _dq_accum_rows(shape)
    dq_accum_strides = (0, dq_accum_rows) if shape.varlen else (shape.nheads * dq_accum_rows, dq_accum_rows)
    fields = dict(batch=shape.batch, nheads=shape.nheads, nheads_k=shape.nheads_k, seqlen_q=shape.seqlen_q,
                  seqlen_k=shape.seqlen_k, headdim=shape.headdim, headdim_padded=tile.headdim,
                  block_major=int(block_major), softmax_scale=scale, scale_log2=scale * math.log2(math.e),
                  stats_batch_stride=stats_strides[0], stats_head_stride=stats_strides[1],
                  dq_accum_batch_stride=dq_accum_strides[0], dq_accum_head_stride=dq_accum_strides[1],
                  window_left=left, window_right=right, inv_softmax_scale=1.0 / scale,
                  dq_semaphore_blocks=semaphore_blocks)
    for name, (batch, row, head) in strides.items():
        fields.update({f"{name}_batch_stride": batch, f"{name}_row_stride": row, f"{name}_head_stride": head})
    if opts.softcap:
        fields["softcap_inner"], fields["softcap_outer"] = scale / opts.softcap, opts.softcap / scale
    if opts.alibi_slopes is not None:
        alibi = inputs["alibi_slopes"]
        fields["alibi_batch_stride"] = _element_strides(alibi)[0] if len(alibi.shape) == 2 else 0
    if opts.attn_bias is not None:
        bias = inputs["attn_bias"]
        fields["bias_is_float32"] = int(_arrays.dtype_name(bias) == "float32")
        fields.update(zip(("bias_batch_stride", "bias_head_stride", "bias_row_stride"),
                          _broadcast_strides(bias.shape, _element_strides(bias))[:3]))
    if opts.dropout_p:
        fields["dropout_keep_below"] = reference.dropout_keep_threshold(opts.dropout_p)
        fields["dropout_scale"] = 1.0 / (1.0 - opts.dropout_p)
    return _params.make_params(**fields)


def _dq_accum_rows(shape):
    """dq_accum's rows per head (per batch entry and head without varlen): every sequence starts at a
    multiple of 8 (Sequence::dq_accum_row0 in cuda_src/common/mask.cuh), the padding and the gaps included."""
    round8 = lambda n: -(-n // 8) * 8  # noqa: E731
    return round8(shape.total_q) + 8 * (shape.batch + 1) if shape.varlen else round8(shape.seqlen_q)


def _broadcast_strides(shape, strides):
    """Strides of a bias of 2 to 4 dims seen as 4-D, with 0 along every broadcast (size-1) dimension."""
    pad = 4 - len(shape)
    return tuple(0 if size == 1 else stride for size, stride in zip((1,) * pad + tuple(shape), (0,) * pad + tuple(strides)))


def _block_grid(blocks, heads, batch, local):
    """(grid, block_major) of a forward or backward kernel: (blocks, heads, batch), or for the LOCAL
    kernels (heads, blocks, batch), which starts every head's heavy causal blocks first
    (cuda_src/common/mask.cuh grid_slot), where the grid's y dimension can hold the blocks."""
    block_major = local and blocks <= _MAX_GRID_YZ
    return ((heads, blocks, batch) if block_major else (blocks, heads, batch)), block_major


def _split_last_wave(kernel, device, shape, grid, params, outputs):
    """The grid of a plain backward whose last partial wave is split (cuda_src/sm80/bwd_schedule.cuh TailSplit;
    `params` and `outputs` get the split's fields and buffers), or `grid` where it is not."""
    blocks, heads_k, batch = grid
    tile = kernel.tile
    units = blocks * heads_k * batch
    steps = shape.nheads // heads_k * -(-shape.seqlen_q // tile.block_m)
    tail_units, tail_parts = _tail_split(units, steps, _resident_ctas(kernel, device))
    extra_z = -(-tail_units * tail_parts // (blocks * heads_k))  # the pieces' z slices
    if not tail_units or batch + extra_z > _MAX_GRID_YZ or (batch + extra_z) * blocks * heads_k >= 2 ** 31:
        return grid
    params["tail_units"], params["tail_parts"] = tail_units, tail_parts
    outputs += [_Output("dkv_accum", (tail_units * 2 * tile.block_n * tile.headdim,), "float32", True),
                _Output("tail_pieces_done", (tail_units,), "int32", True)]
    return blocks, heads_k, batch + extra_z


def _resident_ctas(kernel, device):
    """How many CTAs of `kernel` the device runs at once: SMs times what one SM holds (registers
    are given out 256 per warp, and each CTA takes 1 KiB of shared memory for the system)."""
    function, attributes = load(kernel, device), _device_attributes(device.id)
    warps = kernel.threads // 32
    by_registers = attributes["MaxRegistersPerMultiprocessor"] // (warps * -(-function.num_regs * 32 // 256) * 256)
    by_smem = attributes["MaxSharedMemoryPerMultiprocessor"] // (kernel.smem_bytes + function.shared_size_bytes + 1024)
    per_sm = min(by_registers, by_smem, attributes["MaxThreadsPerMultiProcessor"] // kernel.threads,
                 attributes["MaxBlocksPerMultiprocessor"])
    return attributes["MultiProcessorCount"] * max(per_sm, 1)


def _tail_split(units, steps, resident):
    """(tail_units, tail_parts) for a plain backward of `units` CTAs of `steps` query steps each,
    `resident` of them running at once: the last units % resident CTAs would run while the other
    slots idle, so each may be split into `tail_parts` pieces (cuda_src/sm80/bwd_schedule.cuh TailSplit) that run as
    one or more waves of shorter CTAs. Costs in steps: a CTA's own loads and stores count as one
    step more, a piece's adds and sums as two. A split must save a fifth of the last wave."""
    tail = units % resident
    if tail == 0:
        return 0, 1
    best_cost, best_parts = steps + 1, 1
    for parts in range(2, min(steps, resident) + 1):
        cost = -(-tail * parts // resident) * (-(-steps // parts) + 2)
        if cost < best_cost:
            best_cost, best_parts = cost, parts
    return (tail, best_parts) if best_cost <= 0.8 * (steps + 1) else (0, 1)


def _forward_plan(caller, shape, scale, opts, inputs, varlen):
    tile = _tile("fwd", shape.headdim, caller.device_id)
    q = inputs["q"]
    dtype = _arrays.dtype_name(q)
    strides = {name: _tensor_strides(_element_strides(inputs[name]), varlen) for name in ("q", "k", "v")}
    strides["out"] = _tensor_strides(_contiguous_strides(q.shape), varlen)
    kernel = _kernels.Kernel("fwd", dtype, tile, opts.local, shape.headdim == tile.headdim, opts.extras("fwd"))
    # A one-stage forward waits for each block's K and V. Block-major, the CTAs running at once
    # read the K and V of all of a batch entry's heads, so there they must fit in L2 (hd256 at 16k:
    # 128 MiB, and 3% slower block-major than head-major; bench/NOTES.md v13).
    kv_fits_l2 = 2 * shape.nheads_k * shape.seqlen_k * tile.headdim * 2 <= _device_attributes(caller.device_id)["L2CacheSize"]
    grid, block_major = _block_grid(-(-shape.seqlen_q // tile.block_m), shape.nheads, shape.batch,
                                    opts.local and (tile.stages == 2 or kv_fits_l2))
    outputs = [_Output("out", tuple(q.shape), dtype), _Output("lse", shape.stats, "float32")]
    return _Plan(caller, _param_block(shape, tile, scale, strides, opts, inputs, block_major), inputs, outputs,
                 [_Launch(kernel, grid)], lambda o: (o["out"], o["lse"]))


def _backward_plan(caller, shape, scale, opts, inputs, varlen):
    extras = opts.extras("bwd")
    tile = _tile("bwd_options" if extras else "bwd", shape.headdim, caller.device_id)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    dtype = _arrays.dtype_name(q)
    strides = {name: _tensor_strides(_element_strides(inputs[name]), varlen) for name in ("dout", "q", "k", "v", "out")}
    strides.update({name: _tensor_strides(_contiguous_strides(like.shape), varlen)
                    for name, like in (("dq", q), ("dk", k), ("dv", v))})
    outputs = [_Output("dq", tuple(q.shape), dtype), _Output("dk", tuple(k.shape), dtype),
               _Output("dv", tuple(v.shape), dtype), _Output("dout_dot_out", shape.stats, "float32"),
               _Output("lse_log2", shape.stats, "float32"),
               _Output("dq_accum", (*shape.stats[:-1], _dq_accum_rows(shape), tile.headdim), "float32")]  # zeroed by bwd_dot
    semaphore_blocks = 0
    if opts.deterministic:
        semaphore_blocks = -(-shape.seqlen_q // tile.block_m)
        outputs.append(_Output("dq_semaphore", (shape.batch * shape.nheads * semaphore_blocks,), "int32", True))
    finish = lambda o: (o["dq"], o["dk"], o["dv"])  # noqa: E731
    blocks = -(-shape.seqlen_k // tile.block_n)
    grid, block_major = _block_grid(blocks, shape.nheads_k, shape.batch, opts.local)
    kernel = _kernels.Kernel("bwd", dtype, tile, opts.local, shape.headdim == tile.headdim, extras, opts.deterministic)
    params = _param_block(shape, tile, scale, strides, opts, inputs, block_major, semaphore_blocks)
    if not (opts.local or extras or varlen):  # the kernels that may split their last wave
        grid = _split_last_wave(kernel, caller.device(), shape, grid, params, outputs)
    if opts.return_dbias:
        finish = _add_dbias(caller, params, outputs, opts, shape, inputs["attn_bias"])
    row_grid = (-(-shape.seqlen_q // _kernels.ROW_KERNEL_ROWS), shape.nheads, shape.batch)
    launches = [_Launch(_kernels.Kernel("bwd_dot", dtype), row_grid),
                _Launch(kernel, grid),
                _Launch(_kernels.Kernel("bwd_convert_dq", dtype), row_grid)]
    return _Plan(caller, params, inputs, outputs, launches, finish)


def _add_dbias(caller, params, outputs, opts, shape, bias):
    """Adds the dbias accumulator to a backward plan; returns its finish: (dq, dk, dv, dbias).

    The kernel adds dS into a zeroed float32 array by atomics, with stride 0 along the bias's
    broadcast dimensions. Without atomics colliding that is exact and deterministic; where a
    deterministic backward would have them collide (a broadcast bias), it writes the full
    (batch, nheads, seqlen_q, seqlen_k) instead and sums it in a fixed order afterwards."""
    if bias is None:
        return lambda o: (o["dq"], o["dk"], o["dv"], None)
    full = (shape.batch, shape.nheads, shape.seqlen_q, shape.seqlen_k)
    bias4 = (1,) * (4 - len(bias.shape)) + tuple(bias.shape)
    accum_shape = full if opts.deterministic and bias4 != full else bias4
    accum_strides = _broadcast_strides(accum_shape, _contiguous_strides(accum_shape))
    params["dbias_batch_stride"], params["dbias_head_stride"], params["dbias_row_stride"] = accum_strides[:3]
    outputs.append(_Output("dbias_accum", accum_shape, "float32", True))
    axes = tuple(axis for axis in range(4) if accum_shape[axis] != bias4[axis])
    bias_dtype, bias_shape = _arrays.dtype_name(bias), tuple(bias.shape)
    return lambda o: (o["dq"], o["dk"], o["dv"],
                      caller.reduce(o["dbias_accum"], axes, bias_shape, bias_dtype))

