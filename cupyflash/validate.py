"""Argument checks, one set for every path: the GPU kernels, the NumPy reference, and the PyTorch
and JAX adapters (which call them at trace time). Each error names the argument and what it got.

The rules are the same on every path; only the dtypes of q, k, v differ (the kernels take float16
and bfloat16, the NumPy reference also float32 and float64).
"""

import contextlib
import dataclasses
import math
import numbers
import threading
import weakref

import numpy

from . import _arrays, _config, _kernels, options

GPU_DTYPES = ("float16", "bfloat16")
NUMPY_DTYPES = ("float16", "bfloat16", "float32", "float64")
MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z dimensions, which hold heads and batch entries

check_flag = options.check_flag


@dataclasses.dataclass(frozen=True)
class Shape:
    """Sizes of a call; for varlen, batch counts the sequences and seqlen_* are max_seqlen_*."""
    batch: int
    nheads: int
    nheads_k: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    varlen: bool = False
    total_q: int = 0
    total_k: int = 0

    @property
    def stats(self):
        """lse's shape: (batch, nheads, seqlen_q), or (nheads, total_q) for varlen."""
        return (self.nheads, self.total_q) if self.varlen else (self.batch, self.nheads, self.seqlen_q)


@dataclasses.dataclass(frozen=True)
class Varlen:
    """The packing arguments of a varlen call."""
    cu_seqlens_q: object
    cu_seqlens_k: object
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self):
        """The number of sequences (cu_seqlens_q must have been checked to be 1-D)."""
        return self.cu_seqlens_q.shape[0] - 1


@dataclasses.dataclass
class Call:
    """A checked call: the arrays' kind and device, sizes, q's dtype, the scale, causal and the
    options (name -> checked value, every option of the call's function)."""
    pass_: str
    caller: _arrays.Caller
    shape: Shape
    dtype: str
    scale: float
    causal: bool
    checked: dict
    varlen: Varlen = None

    def on(self, name):
        return options.by_name(name).is_on(self.checked.get(name))

    @property
    def local(self):
        """Whether rows see a bounded key range (causal or a window: the LOCAL kernels)."""
        return self.needs("local")

    def needs(self, kernels):
        """Whether an option that is on needs `kernels` (options.Option.kernels)."""
        return any(o.kernels == kernels and self.on(o.name) for o in options.OPTIONS if o.name in self.checked)

    @property
    def features(self):
        """The score options its kernels compile in (_kernels.FEATURES): those of its options that are on."""
        return tuple(f for f in _kernels.FEATURES if self.needs(f))


def lse_dtype(dtype):
    """lse's dtype for inputs of `dtype`: float32, but float64 for the float64 reference."""
    return "float64" if dtype == "float64" else "float32"


def check_call(pass_, arrays, softmax_scale, causal, given, varlen=None):
    """The Call of a public function's arguments: `arrays` holds every array argument by name
    (q, k, v; dout, out, lse for the backward; cu_seqlens; the options' arrays), `given` every
    option of the function (defaults filled in)."""
    _config.forced_family()  # a bad CUPYFLASH_TILES or _FAMILY is an error on every path, not only at a launch
    _config.forced_kernel_family()
    caller = caller_of(**arrays)
    if varlen is not None:
        check_varlen_shapes(arrays["q"], arrays["k"], varlen)
    shape = check_qkv(arrays["q"], arrays["k"], arrays["v"], varlen,
                      NUMPY_DTYPES if caller.kind == "numpy" else GPU_DTYPES)
    dtype = _arrays.dtype_name(arrays["q"])
    if pass_ == "bwd":
        for name in ("dout", "out"):
            check_like_q(name, arrays[name], arrays["q"])
        check_lse(arrays["lse"], shape, dtype)
    call = Call(pass_, caller, shape, dtype, check_scale(softmax_scale, shape.headdim), check_flag("causal", causal),
                {}, varlen)
    for option in options.for_call(pass_, varlen is not None):
        call.checked[option.name] = option.check(given[option.name], call)
    if varlen is not None:
        check_varlen_values(varlen, arrays, caller)
    return call


def caller_of(**arrays):
    """The Caller of arrays that must all be of one kind and on one device."""
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
            raise TypeError(f"{name} is a {kind} array but {first} is a {kinds[first]} array; pass arrays of one kind")
    kind = kinds[first]
    if kind == "numpy":
        return _arrays.Caller("numpy", -1)
    devices = {name: _arrays.dlpack_device(array)[1] for name, array in arrays.items()}
    for name, device in devices.items():
        if device != devices[first]:
            raise ValueError(f"{name} is on CUDA device {device} but {first} is on CUDA device "
                             f"{devices[first]}; pass arrays on one device")
    return _arrays.Caller(kind, devices[first])


def check_qkv(q, k, v, varlen=None, dtypes=NUMPY_DTYPES):
    """Shape of q, k, v (their layout, q's dtype one of `dtypes` and k's and v's the same, head
    dims, GQA, grid limits)."""
    ndim = 3 if varlen is not None else 4
    layout = "(total, nheads, headdim)" if varlen is not None else "(batch, seqlen, nheads, headdim)"
    for name, array in (("q", q), ("k", k), ("v", v)):
        if not hasattr(array, "shape") or not hasattr(array, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(array).__name__}")
        if len(array.shape) != ndim:
            raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(array.shape)}")
        if 0 in tuple(array.shape)[ndim - 2:] or (varlen is None and 0 in tuple(array.shape)):
            raise ValueError(f"{name} has an empty dimension: shape {tuple(array.shape)}")
    dtype = _arrays.dtype_name(q)
    if dtype not in dtypes:
        raise TypeError(f"q must have dtype {' or '.join(dtypes)}, got {dtype}")
    for name, array in (("k", k), ("v", v)):
        if _arrays.dtype_name(array) != dtype:
            raise TypeError(f"{name} has dtype {_arrays.dtype_name(array)} but q has dtype {dtype}")
    nheads, headdim = q.shape[-2:]
    if varlen is None:
        shape = Shape(q.shape[0], nheads, k.shape[-2], q.shape[1], k.shape[1], headdim)
    else:
        shape = Shape(varlen.batch, nheads, k.shape[-2], varlen.max_seqlen_q, varlen.max_seqlen_k, headdim,
                      True, q.shape[0], k.shape[0])
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if varlen is None and k.shape[0] != shape.batch:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {shape.batch}")
    if k.shape[-1] != headdim:
        raise ValueError(f"k has head dim {k.shape[-1]} but q has head dim {headdim}")
    if nheads % shape.nheads_k:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of k's nheads ({shape.nheads_k})")
    if headdim > _config.MAX_HEADDIM:
        raise ValueError(f"head dim must be at most {_config.MAX_HEADDIM}, got {headdim}")
    for name, array in (("q", q), ("k", k), ("v", v)):
        check_last_dim_contiguous(name, array)
    if shape.batch > MAX_GRID_YZ or nheads > MAX_GRID_YZ:
        raise ValueError(f"batch and nheads must be at most {MAX_GRID_YZ} (grid limits), got "
                         f"batch {shape.batch}, nheads {nheads}")
    return shape


def check_like_q(name, array, q):
    if tuple(array.shape) != tuple(q.shape):
        raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(array.shape)}")
    if _arrays.dtype_name(array) != _arrays.dtype_name(q):
        raise TypeError(f"{name} has dtype {_arrays.dtype_name(array)} but q has dtype {_arrays.dtype_name(q)}")
    check_last_dim_contiguous(name, array)


def check_lse(lse, shape, dtype):
    """lse as the forward returns it: shape.stats, in lse_dtype(q's dtype)."""
    if tuple(lse.shape) != shape.stats:
        names = "(nheads, total_q)" if shape.varlen else "(batch, nheads, seqlen_q)"
        raise ValueError(f"lse must have shape {names} = {shape.stats}, got {tuple(lse.shape)}")
    if _arrays.dtype_name(lse) != lse_dtype(dtype):
        raise TypeError(f"lse must have dtype {lse_dtype(dtype)}, got {_arrays.dtype_name(lse)}")


def check_last_dim_contiguous(name, array):
    """The kernels read whole rows of the last dimension; the reference takes the same inputs. (An
    array without elements has no rows to read: NumPy gives such arrays zero strides.)"""
    strides = _arrays.element_strides(array)
    if strides is not None and array.shape[-1] > 1 and strides[-1] != 1 and 0 not in tuple(array.shape):
        raise ValueError(f"{name} must be contiguous in its last dimension (headdim), got strides {strides} "
                         f"(in elements)")


def check_scale(softmax_scale, headdim):
    """The softmax scale: headdim ** -0.5 by default (the caller's head dim), else a positive finite number."""
    if softmax_scale is None:
        return headdim ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, numpy.number)):
        raise TypeError(f"softmax_scale must be a positive number or None, got {softmax_scale!r}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be finite and positive, got {softmax_scale!r}")
    return scale


def check_packed(name, array, ndim, count):
    """A packed qkv (count 3) or kv (count 2) array of `ndim` dims: (batch, seqlen, count, nheads,
    headdim), or (total, count, nheads, headdim) for varlen."""
    shape = tuple(getattr(array, "shape", ()))
    if len(shape) != ndim or shape[ndim - 3] != count:
        where = "(batch, seqlen, " if ndim == 5 else "(total, "
        raise ValueError(f"{name} must be {ndim}-D {where}{count}, nheads, headdim), got shape {shape}")


# --------------------------------------------------------------------------------------------
# Varlen: the shapes and dtypes (known at trace time), then the values (on the host).

def check_varlen_shapes(q, k, varlen):
    """What can be checked of a varlen call's packing without reading cu_seqlens' values (k None: a
    paged cache, checked on its own)."""
    for side, cu, packed in (("q", varlen.cu_seqlens_q, q), ("k", varlen.cu_seqlens_k, k)):
        if not hasattr(cu, "shape") or not hasattr(cu, "dtype"):
            raise TypeError(f"cu_seqlens_{side} must be an int32 array, got {type(cu).__name__}")
        if _arrays.dtype_name(cu) != "int32":
            raise TypeError(f"cu_seqlens_{side} must be an int32 array, got dtype {_arrays.dtype_name(cu)}")
        if len(cu.shape) != 1 or cu.shape[0] < 1:
            raise ValueError(f"cu_seqlens_{side} must be 1-D (batch + 1,), got shape {tuple(cu.shape)}")
        if packed is not None and len(getattr(packed, "shape", ())) != 3:
            raise ValueError(f"{side} must be 3-D (total, nheads, headdim) for varlen, got shape "
                             f"{tuple(getattr(packed, 'shape', ()))}")
    if tuple(varlen.cu_seqlens_q.shape) != tuple(varlen.cu_seqlens_k.shape):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{varlen.cu_seqlens_q.shape[0]} and {varlen.cu_seqlens_k.shape[0]}")
    for side in ("q", "k"):
        value = getattr(varlen, f"max_seqlen_{side}")
        if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"max_seqlen_{side} must be an int >= 0 (the longest sequence), got {value!r}")


_host_sync = threading.local()


@contextlib.contextmanager
def no_host_sync():
    """A context in which GPU calls never wait on the host for device values: the varlen
    cu_seqlens are not read and checked there. The kernels clamp each sequence into the packed
    arrays and to max_seqlen, so values that would fail the check give wrong rows, never an access
    outside the buffers. Capturing a CUDA graph implies it (a capture cannot read device memory)."""
    before = getattr(_host_sync, "off", False)
    _host_sync.off = True
    try:
        yield
    finally:
        _host_sync.off = before


def host_sync_off():
    """Whether this thread is inside no_host_sync()."""
    return getattr(_host_sync, "off", False)


def reads_device_values(caller):
    """Whether a call may read device values on the host (not under no_host_sync or a graph capture)."""
    return caller.kind == "numpy" or not (host_sync_off() or caller.capturing())


def check_varlen_values(varlen, arrays, caller):
    """cu_seqlens read on the host (a GPU array waits for the work that computes it): each
    non-decreasing from 0 to its packed total, max_seqlen at least every length. Skipped where
    reads_device_values says no, and for torch tensors that passed with the same totals and maxima
    and that torch has not written since (their version counters): a training step's layers, forward
    and backward, then wait once for a batch's cu_seqlens, not once a call. (CuPy arrays and torch's
    inference tensors keep no such count: they are read every call.)"""
    if not reads_device_values(caller):
        return
    cu_q, cu_k = varlen.cu_seqlens_q, varlen.cu_seqlens_k
    totals = (arrays["q"].shape[0], arrays["k"].shape[0])
    passed = None
    if caller.kind == "torch" and not (cu_q.is_inference() or cu_k.is_inference()):
        passed = (cu_q._version, cu_k._version, *totals, varlen.max_seqlen_q, varlen.max_seqlen_k)
        before = _passed_packings.get(id(cu_q))
        if before is not None and before[0]() is cu_q and before[1]() is cu_k and before[2:] == passed:
            return
    check_packing(varlen, _arrays.to_host(cu_q, caller), _arrays.to_host(cu_k, caller), *totals)
    if passed is not None:
        forget = lambda _, key=id(cu_q): _passed_packings.pop(key, None)  # noqa: E731
        _passed_packings[id(cu_q)] = (weakref.ref(cu_q, forget), weakref.ref(cu_k), *passed)


# The torch packings that passed, by id(cu_seqlens_q) (a tensor compares by value, so it cannot be a
# key): (cu_seqlens_q, cu_seqlens_k (weak references), their version counters, the totals, the maxima)
_passed_packings = {}


def check_packing(varlen, cu_seqlens_q, cu_seqlens_k, total_q, total_k):
    """A varlen packing's values, its cu_seqlens given as host arrays: each non-decreasing from 0 to
    its packed total, max_seqlen at least every length."""
    for side, host, total in (("q", cu_seqlens_q, total_q), ("k", cu_seqlens_k, total_k)):
        check_cu_seqlens(f"cu_seqlens_{side}", host, None, total)
        check_max_seqlen(f"max_seqlen_{side}", getattr(varlen, f"max_seqlen_{side}"), host)


def check_cu_seqlens(name, cu_seqlens, batch, total):
    """Checks the cumulative sequence lengths `name` (a host array); returns it as a NumPy array.

    It must be a 1-D int32 array of length batch + 1 (any length >= 1 when batch is None) that
    starts at 0, never decreases and ends at total, the packed length (when total is not None).
    TypeError for a wrong type or dtype, ValueError for the rest."""
    dtype = getattr(cu_seqlens, "dtype", None)
    if dtype is None:
        raise TypeError(f"{name} must be an int32 array, got {type(cu_seqlens).__name__}")
    if dtype != numpy.int32:
        raise TypeError(f"{name} must be an int32 array, got dtype {dtype}")
    cu = numpy.asarray(cu_seqlens)
    if cu.ndim != 1:
        raise ValueError(f"{name} must be 1-D (batch + 1,), got shape {cu.shape}")
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"{name} must have length batch + 1 = {batch + 1}, got {cu.shape[0]}")
    if cu.shape[0] < 1:
        raise ValueError(f"{name} must have length batch + 1 >= 1, got an empty array")
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
    lengths = numpy.diff(cu.astype(numpy.int64))  # int64: differences of extreme int32 values cannot wrap
    if (lengths < 0).any():
        b = int(numpy.argmax(lengths < 0))
        raise ValueError(f"{name} must be non-decreasing, got {name}[{b}] = {cu[b]} > {name}[{b + 1}] = {cu[b + 1]}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {name}[-1] = {cu[-1]}")
    return cu


def check_max_seqlen(name, max_seqlen, cu_seqlens):
    """Checks that the integer `name` bounds every sequence of cu_seqlens (as check_cu_seqlens passed it)."""
    if isinstance(max_seqlen, (bool, numpy.bool_)) or not isinstance(max_seqlen, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {max_seqlen!r}")
    lengths = numpy.diff(numpy.asarray(cu_seqlens, dtype=numpy.int64))
    longest = int(lengths.max()) if lengths.size else 0
    if max_seqlen < longest or max_seqlen < 0:
        raise ValueError(f"{name} must be >= the longest sequence ({longest}), got {max_seqlen!r}")


# --------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: the caches and what is appended to them.

PAGE_MULTIPLE = 16  # a paged cache's page size is a multiple of this (16 is vLLM's default)
# flash_attn_with_kvcache's array arguments after q, k_cache and v_cache, in its signature's order.
KVCACHE_ARRAYS = ("k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx", "cache_leftpad",
                  "block_table")


@dataclasses.dataclass(frozen=True)
class KVCache:
    """The cache arguments of a flash_attn_with_kvcache call, checked. cache_seqlens, cache_batch_idx,
    cache_leftpad and block_table are arrays on the call's device (or NumPy arrays on the NumPy
    path) or None; an int cache_seqlens becomes None with `seqlens_int` set."""
    k_cache: object
    v_cache: object
    k: object
    v: object
    rotary_cos: object
    rotary_sin: object
    cache_seqlens: object
    seqlens_int: int
    cache_batch_idx: object
    cache_leftpad: object
    block_table: object
    rotary_interleaved: bool
    num_splits: int
    capacity: int   # positions per sequence: the cache's seqlen, or pages per sequence x page size
    seqlen_new: int

    @property
    def paged(self):
        return self.block_table is not None

    @property
    def page_size(self):
        """Rows per page of a paged cache; 0 for a dense one."""
        return int(self.k_cache.shape[1]) if self.paged else 0


def check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                  cache_leftpad, block_table, softmax_scale, causal, given, rotary_interleaved, num_splits,
                  traced=False):
    """(Call, KVCache) of a flash_attn_with_kvcache call; `given` holds the options it takes
    (options.for_call("kvcache"), defaults filled in). Values in device arrays (the lengths, the
    indices, the block table) are checked on the host where reads_device_values allows. `traced`:
    the arrays are a trace's (JAX), checked for what they are, not where or what they hold (the
    call checks again when it runs)."""
    _config.forced_family()
    _config.forced_kernel_family()
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache)
    for name, value in (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                        ("block_table", block_table), ("alibi_slopes", given.get("alibi_slopes"))):
        if value is not None:
            arrays[name] = value
    seqlens_int = None
    if seqlens_given_as_int(cache_seqlens):
        seqlens_int, cache_seqlens = check_seqlens_int(cache_seqlens), None
    elif cache_seqlens is not None:
        arrays["cache_seqlens"] = cache_seqlens
    caller = _arrays.Caller("numpy", -1) if traced else caller_of(**arrays)
    dtypes = NUMPY_DTYPES if caller.kind == "numpy" else GPU_DTYPES

    for name, array in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_4d(name, array, "(batch, seqlen_q, nheads, headdim)" if name == "q" else
                  "(batch_cache, seqlen_cache, nheads_k, headdim) or, paged, (num_blocks, page_size, nheads_k, headdim)")
    dtype = _arrays.dtype_name(q)
    if dtype not in dtypes:
        raise TypeError(f"q must have dtype {' or '.join(dtypes)}, got {dtype}")
    batch, seqlen_q, nheads, headdim = (int(n) for n in q.shape)
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    for name, array in (("k_cache", k_cache), ("v_cache", v_cache)):
        if _arrays.dtype_name(array) != dtype:
            raise TypeError(f"{name} has dtype {_arrays.dtype_name(array)} but q has dtype {dtype}")
    rows, seqlen_cache, nheads_k, cache_headdim = (int(n) for n in k_cache.shape)
    if cache_headdim != headdim:
        raise ValueError(f"k_cache has head dim {cache_headdim} but q has head dim {headdim}")
    if nheads % nheads_k:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of k_cache's nheads ({nheads_k})")
    if headdim > _config.MAX_HEADDIM:
        raise ValueError(f"head dim must be at most {_config.MAX_HEADDIM}, got {headdim}")

    if block_table is not None:
        _check_index_array("block_table", block_table, 2)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch, pages per sequence) with batch = {batch}, got "
                             f"{tuple(block_table.shape)}")
        if seqlen_cache % PAGE_MULTIPLE:
            raise ValueError(f"a paged k_cache's page size (its dim 1) must be a multiple of {PAGE_MULTIPLE}, got "
                             f"{seqlen_cache}")
        for name, value in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if value is not None:
                raise ValueError(f"{name} does not combine with block_table (a paged cache): pass None")
        capacity = int(block_table.shape[1]) * seqlen_cache
    else:
        capacity = seqlen_cache
        if cache_batch_idx is None and rows < batch:
            raise ValueError(f"k_cache has {rows} rows (dim 0) for a batch of {batch}: pass cache_batch_idx or a "
                             f"cache with a row per batch entry")

    if (k is None) != (v is None):
        raise ValueError(f"k and v come together: got k {'None' if k is None else 'an array'} and v "
                         f"{'None' if v is None else 'an array'}")
    seqlen_new = 0
    if k is not None:
        for name, array in (("k", k), ("v", v)):
            _check_4d(name, array, "(batch, seqlen_new, nheads_k, headdim)")
            if _arrays.dtype_name(array) != dtype:
                raise TypeError(f"{name} has dtype {_arrays.dtype_name(array)} but q has dtype {dtype}")
        if tuple(k.shape) != tuple(v.shape) or k.shape[0] != batch or tuple(k.shape[2:]) != (nheads_k, headdim):
            raise ValueError(f"k and v must have shape (batch, seqlen_new, nheads_k, headdim) = ({batch}, seqlen_new, "
                             f"{nheads_k}, {headdim}), got k {tuple(k.shape)} and v {tuple(v.shape)}")
        seqlen_new = int(k.shape[1])
    if seqlen_new > capacity:
        raise ValueError(f"k has {seqlen_new} new tokens but the cache holds {capacity} per sequence")

    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin come together: pass both or neither")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos and rotary_sin rotate the new keys: they need k and v")
        for name, table in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if len(table.shape) != 2 or table.shape[1] < 1 or 2 * table.shape[1] > headdim:
                raise ValueError(f"{name} must be 2-D (seqlen_ro, rotary_dim / 2) with rotary_dim <= headdim = "
                                 f"{headdim}, got shape {tuple(table.shape)}")
            if _arrays.dtype_name(table) not in (dtype, "float32"):
                raise TypeError(f"{name} must have q's dtype ({dtype}) or float32, got {_arrays.dtype_name(table)}")
            check_last_dim_contiguous(name, table)
        if tuple(rotary_cos.shape) != tuple(rotary_sin.shape):
            raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(rotary_cos.shape)} and "
                             f"{tuple(rotary_sin.shape)}")
        if _arrays.dtype_name(rotary_cos) != _arrays.dtype_name(rotary_sin):
            raise TypeError(f"rotary_cos and rotary_sin must have one dtype, got {_arrays.dtype_name(rotary_cos)} and "
                            f"{_arrays.dtype_name(rotary_sin)}")
    rotary_interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    num_splits = check_num_splits(num_splits)

    for name, value in (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                        ("cache_leftpad", cache_leftpad)):
        if value is not None:
            _check_index_array(name, value, 1)
            if tuple(value.shape) != (batch,):
                raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(value.shape)}")
    for name, array in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if array is not None:
            check_last_dim_contiguous(name, array)
    if seqlens_int is not None and seqlens_int + seqlen_new > capacity:
        raise ValueError(f"cache_seqlens ({seqlens_int}) + the {seqlen_new} new tokens exceed the cache's "
                         f"{capacity} positions per sequence")
    if cache_seqlens is None and seqlens_int is None and seqlen_new:
        raise ValueError("k and v are appended at cache_seqlens: pass cache_seqlens (without it the cache is full)")

    shape = Shape(batch, nheads, nheads_k, seqlen_q, capacity, headdim)
    call = Call("kvcache", caller, shape, dtype, check_scale(softmax_scale, headdim), check_flag("causal", causal), {})
    for option in options.for_call("kvcache"):
        call.checked[option.name] = option.check(given[option.name], call)
    cache = KVCache(k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, seqlens_int, cache_batch_idx,
                    cache_leftpad, block_table, rotary_interleaved, int(num_splits), capacity, seqlen_new)
    if not traced and reads_device_values(caller):
        _check_kvcache_values(call, cache, rows)
    return call, cache


def seqlens_given_as_int(cache_seqlens):
    """Whether cache_seqlens is one length for every sequence: an int (a NumPy integer scalar too),
    or anything else that is not an array (check_seqlens_int names it)."""
    return cache_seqlens is not None and (isinstance(cache_seqlens, numbers.Integral) or not _is_array(cache_seqlens))


def check_seqlens_int(cache_seqlens):
    """An int cache_seqlens (every sequence's length)."""
    if isinstance(cache_seqlens, (bool, numpy.bool_)) or not isinstance(cache_seqlens, numbers.Integral):
        raise TypeError(f"cache_seqlens must be an int or an int32 array of shape (batch,), got {cache_seqlens!r}")
    if not 0 <= cache_seqlens < 2 ** 31:
        raise ValueError(f"cache_seqlens must be >= 0 (and an int32), got {cache_seqlens}")
    return int(cache_seqlens)


def check_num_splits(num_splits):
    if isinstance(num_splits, (bool, numpy.bool_)) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 picks it), got {num_splits!r}")
    return int(num_splits)


def _is_array(value):
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _check_4d(name, array, layout):
    if not _is_array(array):
        raise TypeError(f"{name} must be an array, got {type(array).__name__}")
    if len(array.shape) != 4:
        raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(array.shape)}")
    if 0 in tuple(array.shape):
        raise ValueError(f"{name} has an empty dimension: shape {tuple(array.shape)}")


def _check_index_array(name, array, ndim):
    if not _is_array(array):
        raise TypeError(f"{name} must be an int32 array, got {type(array).__name__}")
    if _arrays.dtype_name(array) != "int32":
        raise TypeError(f"{name} must be an int32 array, got dtype {_arrays.dtype_name(array)}")
    if len(array.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(array.shape)}")


def _check_kvcache_values(call, cache, rows):
    """The values of the lengths, indices and block table, read on the host (a GPU array waits for
    the work that computes it)."""
    caller, batch = call.caller, call.shape.batch
    host = lambda array: None if array is None else numpy.asarray(_arrays.to_host(array, caller))  # noqa: E731
    if cache.cache_seqlens is not None:
        lengths = host(cache.cache_seqlens).astype(numpy.int64)
    else:
        full = cache.capacity - cache.seqlen_new if cache.seqlens_int is None else cache.seqlens_int
        lengths = numpy.full(batch, full, numpy.int64)
    ends = lengths + cache.seqlen_new
    for b in range(batch):
        if lengths[b] < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got cache_seqlens[{b}] = {lengths[b]}")
        if ends[b] > cache.capacity:
            raise ValueError(f"cache_seqlens[{b}] ({lengths[b]}) + the {cache.seqlen_new} new tokens exceed the "
                             f"cache's {cache.capacity} positions per sequence")
    index = host(cache.cache_batch_idx)
    if index is not None and ((index < 0) | (index >= rows)).any():
        b = int(numpy.argmax((index < 0) | (index >= rows)))
        raise ValueError(f"cache_batch_idx must index k_cache's {rows} rows, got cache_batch_idx[{b}] = {index[b]}")
    leftpad = host(cache.cache_leftpad)
    if leftpad is not None and ((leftpad < 0) | (leftpad > lengths)).any():
        b = int(numpy.argmax((leftpad < 0) | (leftpad > lengths)))
        raise ValueError(f"cache_leftpad must be in [0, cache_seqlens], got cache_leftpad[{b}] = {leftpad[b]} with "
                         f"cache_seqlens[{b}] = {lengths[b]}")
    table = host(cache.block_table)
    if table is not None:
        _check_pages(table, ends, cache.k_cache, "k_cache")
    if cache.rotary_cos is not None:
        last = int((lengths + max(cache.seqlen_new, call.shape.seqlen_q if call.local else 1)).max())
        if cache.rotary_cos.shape[0] < last:
            raise ValueError(f"rotary_cos and rotary_sin have {cache.rotary_cos.shape[0]} rows, but positions up to "
                             f"{last - 1} are rotated (cache_seqlens + the new tokens, or + seqlen_q for q)")


def check_paged_varlen(q, k_cache, v_cache, varlen, block_table, alibi_slopes=None):
    """(the Caller, the key lengths, the block table on the host) of a varlen call whose k and v are a
    paged cache read through block_table (the varlen checks follow on the gathered arrays); the
    lengths and the block table are read on the host, or are None where the call may not read them
    (reads_device_values)."""
    caller = caller_of(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=varlen.cu_seqlens_q,
                       cu_seqlens_k=varlen.cu_seqlens_k, block_table=block_table,
                       **({} if alibi_slopes is None else dict(alibi_slopes=alibi_slopes)))
    check_paged_varlen_shapes(q, k_cache, v_cache, varlen, block_table)
    if not reads_device_values(caller):
        return caller, None, None
    table = numpy.asarray(_arrays.to_host(block_table, caller))
    lengths = check_paged_varlen_values(_arrays.to_host(varlen.cu_seqlens_k, caller), table, k_cache)
    return caller, lengths, table


def check_paged_varlen_shapes(q, k_cache, v_cache, varlen, block_table):
    """What can be checked of a varlen call over a paged cache without reading values (shapes and
    dtypes: cupyflash.jax checks these of traced arrays)."""
    for name, array in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_4d(name, array, "(num_blocks, page_size, nheads_k, headdim) with block_table")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k and v (the paged caches) must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if k_cache.shape[1] % PAGE_MULTIPLE:
        raise ValueError(f"a paged k's page size (its dim 1) must be a multiple of {PAGE_MULTIPLE}, got "
                         f"{k_cache.shape[1]}")
    _check_index_array("block_table", block_table, 2)
    check_varlen_shapes(q, None, varlen)
    batch = varlen.batch
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape (batch, pages per sequence) with batch = {batch}, got "
                         f"{tuple(block_table.shape)}")


def check_paged_varlen_values(cu_seqlens_k, block_table, k_cache):
    """The key lengths (NumPy) of a varlen call over a paged cache, from cu_seqlens_k and block_table on
    the host: each sequence fits its pages, and the pages it uses are blocks of the cache."""
    cu = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, block_table.shape[0], None)
    lengths = numpy.diff(cu.astype(numpy.int64))
    page = k_cache.shape[1]
    for b, length in enumerate(lengths):
        if length > block_table.shape[1] * page:
            raise ValueError(f"sequence {b} has {length} keys (cu_seqlens_k) but block_table gives it "
                             f"{block_table.shape[1]} pages of {page}")
    _check_pages(block_table, lengths, k_cache, "k")
    return lengths


def _check_pages(table, lengths, cache, name):
    """The blocks that hold each sequence's first lengths[b] positions (block_table on the host) are
    blocks of the paged cache `name`."""
    page, blocks = cache.shape[1], cache.shape[0]
    for b, length in enumerate(lengths):
        used = table[b, :-(-int(length) // page)]
        if ((used < 0) | (used >= blocks)).any():
            p = int(numpy.argmax((used < 0) | (used >= blocks)))
            raise ValueError(f"block_table[{b}, {p}] = {used[p]} is not a block of {name} (0 .. {blocks - 1})")
