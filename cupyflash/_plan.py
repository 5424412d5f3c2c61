"""Launch plans: everything about a launch but the data pointers, cached per call signature.

The kernels, grids and the parameter block's sizes and strides follow from the arrays' kinds,
shapes, strides, dtypes and device and from the options, all of which validation has passed for.
So a plan is cached under exactly those: a repeated call costs its output allocations, one pointer
patch and the launches (at seqlen 1k a kernel runs for tens of microseconds, so the host must not).
"""

import ctypes
import dataclasses
import math
import operator
import threading
import typing

import numpy

from . import _arrays, _config, _kernels, _launch, _params, _schedule, _tma, options
from ._compile import load
from .validate import MAX_GRID_YZ

_plans = {}
_MAX_PLANS = 4096  # shapes seen by one process; past this the cache starts afresh
_TILE_INPUTS = ("q", "k", "v", "out", "dout")  # 16-bit tensors read by 16-byte cp.async
_FIELDS = {"seed": "dropout_seed_device"}  # inputs whose FlashParams field has another name
# Options keyed by their type alone: arrays (keyed with the other arrays) and the seed (patched per call).
_KEYED_BY_TYPE = frozenset(o.name for o in options.OPTIONS if o.kind in ("array", "seed"))


def cached(key):
    return None if key is None else _plans.get(key)


def _hashable(value):
    """value as part of a cache key (lists become tuples); TypeError if it cannot be one."""
    if isinstance(value, list):
        return ("list",) + tuple(_hashable(v) for v in value)
    hash(value)
    return value


def plan_key(pass_, arrays, softmax_scale, causal, given, varlen, return_dbias=False):
    """The cache key of a call, or None when some argument cannot be part of one (arrays that are
    not torch tensors or CuPy arrays, unhashable options). Option types are part of it, so that
    a call with causal=1 still meets the bool check, and so is a forced tile table or kernel
    family, which picks other kernels for the same arrays. Arrays are keyed by their layout; the
    dropout seed's value is not part of it: plans patch it per call."""
    try:
        key = [pass_, _config.forced_choices(), type(softmax_scale), _hashable(softmax_scale),
               type(causal), causal, return_dbias]
        for name, value in given.items():
            key += (name, type(value)) if name in _KEYED_BY_TYPE else (name, type(value), _hashable(value))
        if varlen is not None:
            key += (type(varlen.max_seqlen_q), _hashable(varlen.max_seqlen_q), type(varlen.max_seqlen_k),
                    _hashable(varlen.max_seqlen_k))
    except TypeError:
        return None
    for name, array in arrays.items():
        cls = type(array)
        kind = _arrays.kind_of_type(cls)
        if kind == "torch":
            key += (name, cls, array.shape, array.stride(), array.dtype, array.get_device())
        elif kind == "cupy":
            key += (name, cls, array.shape, array.strides, array.dtype, array.data.device_id)
        else:
            return None
    return tuple(key)


def new_plan(call, arrays, key, return_dbias=False):
    """The plan of a checked call (validate.Call), cached under `key` unless an input had to be copied."""
    inputs, copied = _launchable(call.caller, arrays)
    plan = (_forward_plan if call.pass_ == "fwd" else _backward_plan)(call, inputs, return_dbias)
    if not copied:
        store(key, plan)
    return plan, inputs


def store(key, plan):
    """Caches `plan` under `key` (None: a call that cannot be keyed, not cached)."""
    if key is not None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan


def _alignment(name, array):
    """The byte alignment the kernels need of an input's address."""
    if name in _TILE_INPUTS:
        return 16
    if name == "seed":
        return 8  # read as one 64-bit word
    return array.element_size() if hasattr(array, "element_size") else array.itemsize


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _launchable(caller, arrays):
    """(inputs as the plan takes them, whether any was copied). Views the kernels cannot read
    (16-bit tensors whose rows are not 16-byte aligned; row statistics and cu_seqlens that are not
    contiguous; the options' arrays not contiguous in their last dimension) are copied once,
    which keeps them correct."""
    from .validate import check_last_dim_contiguous
    result, copied = {}, False
    for name, array in arrays.items():
        array = caller.launchable(array)
        strides = _arrays.element_strides(array)
        aligned = caller.data_pointer(array) % _alignment(name, array) == 0
        if name in _TILE_INPUTS:
            check_last_dim_contiguous(name, array)  # JAX and other producers show their strides only now
            ok = aligned and all(s * 2 % 16 == 0 for s in strides[:-1])
        elif name in ("lse", "cu_seqlens_q", "cu_seqlens_k", "seed"):
            ok = aligned and strides == _contiguous_strides(array.shape)
        else:  # the options' arrays
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


@dataclasses.dataclass(frozen=True)
class _Launch:
    kernel: _kernels.Kernel
    grid: tuple
    dependent: bool = False  # a dependent launch where the device has them (_launch): the kernel waits
    cluster: int = 1         # CTAs per thread-block cluster along x (_launch; only where the device has them)


@dataclasses.dataclass(frozen=True)
class _Output:
    name: str             # its FlashParams field
    shape: tuple
    dtype: str
    zeroed: bool = False
    scratch: bool = False  # read by the kernels alone: carved from one workspace per call

    @property
    def nbytes(self):  # of scratch, which is never bfloat16 (NumPy has no name for that)
        return math.prod(self.shape) * numpy.dtype(self.dtype).itemsize


_SCRATCH_ALIGNMENT = 256
# A plan keeps a plain workspace up to this size per stream (Plan._scratch): small calls, whose
# kernels take microseconds, save the allocation; larger ones would hold memory the allocator could reuse.
_KEPT_SCRATCH_BYTES = 32 << 20
_MAX_KEPT_SCRATCH = 64  # streams seen by one plan; past this its kept workspaces start afresh


class _Workspace(typing.NamedTuple):
    """One buffer of a plan's scratch, carved into the scratch outputs of one kind (plain or zeroed)."""
    allocate: object  # a function of a call's inputs (Plan.call's) that returns a new one
    offsets: list     # (parameter slot, byte offset) of each scratch output in it
    keepable: bool    # small and plain: kept per stream where the call keeps buffers (Plan._scratch)
    nbytes: int
    zeroed: bool


class Plan:
    """The launches of one call signature, with the parameter block ready but for its pointers.

    `run(arrays, seed, into, stream, workspaces=...)` allocates the outputs (but those `into` gives
    as addresses) and the scratch (but where `workspaces` gives its buffers' addresses, of at least
    `scratch_sizes` bytes: the caller's, such as XLA's), writes the inputs' (arrays or addresses)
    and outputs' addresses (and an int dropout seed; a seed array is an input) into the block,
    launches every kernel on `stream` (the caller's current one by default) and returns the
    results (the outputs but scratch) in order, or `finish` of them by name where it is given; it
    returns None when an input's address is not aligned as the kernels need (then the caller's slow
    path copies it)."""

    def __init__(self, caller, params, inputs, outputs, launches, finish=None, maps=None):
        import cupy
        self.caller, self.device_id, self.finish = caller, caller.device_id, finish
        self.hands_back = caller.kind not in ("torch", "cupy")  # results go back through give_back
        self.input_names = list(inputs)  # the order of call()'s inputs
        self.alignments = [16 if maps and name in maps.inputs else _alignment(name, array)  # (TMA's)
                           for name, array in inputs.items()]
        self.kernels = [l.kernel for l in launches]
        with caller.context():  # a kernel's CUfunction belongs to the context current when it is loaded
            launches = [l for l in launches if 0 not in l.grid]
            functions = [load(l.kernel, caller.device()).kernel.ptr for l in launches]
            self.context = cupy.cuda.driver.ctxGetCurrent()
        self.launch_kernel, self.current_context = cupy.cuda.driver.launchKernel, cupy.cuda.driver.ctxGetCurrent
        self.memset = cupy.cuda.runtime.memsetAsync
        self.words = (ctypes.c_uint64 * (params.nbytes // 8)).from_buffer(params)
        self.params = params  # owns the words
        slot = lambda name: params.dtype.fields[_FIELDS.get(name, name)][1] // 8  # noqa: E731
        anchor = self.input_names.index(_arrays.ANCHOR)
        position = lambda name: None if name is None else self.input_names.index(name)  # noqa: E731
        # Results: their names and allocators (functions of call()'s inputs). Scratch: per workspace
        # (plain, zeroed), its allocator, (slot, byte offset) of each buffer in it, and whether it is
        # kept per stream (see _scratch).
        results = [o for o in outputs if not o.scratch]
        self.result_names = [o.name for o in results]
        self.allocators = [caller.allocator(o.shape, o.dtype, o.zeroed, position(_twin(o, inputs)), anchor)
                           for o in results]
        # Buffers a plan keeps across calls (scratch per stream, sinks): not by default for torch,
        # whose graph pools (torch.compile's graph trees warm up there outside capture) must hold
        # no tensor of ours across calls; the drop-in's eager calls, which run in none, ask for
        # kept scratch (call's `keep`).
        self.keeps_buffers = caller.kind != "torch"
        self.workspaces = []
        for zeroed in (False, True):
            offsets, size = [], 0
            for o in outputs:
                if o.scratch and o.zeroed == zeroed:
                    offsets.append((slot(o.name), size))
                    size += -(-o.nbytes // _SCRATCH_ALIGNMENT) * _SCRATCH_ALIGNMENT
            if offsets:
                keepable = not zeroed and size <= _KEPT_SCRATCH_BYTES
                self.workspaces.append(_Workspace(caller.allocator((size,), "uint8", zeroed, None, anchor), offsets,
                                                  keepable, size, zeroed))
        # The block's pointer words in the order call() gathers them: inputs, results, scratch.
        self.slots = ([slot(name) for name in self.input_names] + [slot(name) for name in self.result_names]
                      + [s for w in self.workspaces for s, _ in w.offsets])
        self.scratch_offsets = [[offset for _, offset in w.offsets] for w in self.workspaces]
        # A caller's workspace may start anywhere XLA aligns its buffers (less than the offsets' alignment).
        self.scratch_sizes = tuple(w.nbytes + _SCRATCH_ALIGNMENT for w in self.workspaces)
        self.scratch_by_stream = {}  # (stream, workspace index) -> the workspace kept for that stream
        # stream -> (its kept workspaces, their buffers' addresses in slot order), where every workspace is kept
        self.kept_scratch = {} if all(w.keepable for w in self.workspaces) else None
        self.pointer_of, self.stream_of = caller.pointer_reader(), caller.stream_reader()
        self.capturing = caller.capture_reader()
        dropout = params["dropout_scale"][0] != 0
        self.seed_slot = slot("dropout_seed") if dropout and "seed" not in inputs else None
        # The kernels' arguments: the parameter block, and for the wgmma kernels the tensor maps
        # (`maps`, a _tma.Maps of the inputs named by maps.inputs, aimed at each call's); a kernel
        # of one parameter ignores the second.
        self.maps = maps
        self.map_inputs = [self.input_names.index(name) for name in maps.inputs] if maps else []
        self.argv = (ctypes.c_void_p * 2)(ctypes.addressof(self.words), maps.address if maps else 0)
        argv_address = ctypes.addressof(self.argv)
        # Each launch's arguments, and its _launch.ExtendedLaunch where it has attributes (else None).
        extended = _launch.available(_schedule.device_info(self.device_id)[1])
        self.launches = []
        for function, l in zip(functions, launches):
            launch = (function, l.grid, l.kernel.threads, l.kernel.smem_bytes, argv_address)
            dependent = extended and l.dependent
            self.launches.append((*launch, _launch.ExtendedLaunch(*launch, dependent, l.cluster)
                                  if dependent or l.cluster > 1 else None))
        self.lock = threading.Lock()
        self.captured_scratch = []  # of CuPy graph captures, which replays still write
        self.sinks = {}  # result name -> the array of the calls that drop it

    def run(self, arrays, seed, into=None, stream=None, dropped=(), workspaces=None):
        """call() with the inputs by name."""
        return self.call([arrays[name] for name in self.input_names], seed, into, stream, dropped, workspaces)

    def call(self, inputs, seed=None, into=None, stream=None, dropped=(), workspaces=None, keep=None):
        """The class's run, with the inputs (arrays or addresses) in the order of `input_names`;
        `keep` says whether its small scratch is kept per stream (default: the caller's policy).
        Eager calls run it thousands of times a training step, in a torch fwd+bwd loop with cold
        caches after each thread switch: every step here costs, so it takes as few as it can."""
        pointer_of = self.pointer_of
        pointers = [array if type(array) is int else pointer_of(array) for array in inputs]
        if any(map(operator.mod, pointers, self.alignments)):
            return None
        if self.seed_slot is not None and not (isinstance(seed, (int, numpy.integer)) and 0 <= seed < 2 ** 64):
            return None  # the slow path names the bad seed
        if self.current_context() != self.context:
            # Launches need the device's context current: another device's may be, or none (a new
            # thread, such as autograd's, whose first CUDA call this may be).
            with self.caller.context():
                return self.call(inputs, seed, into, stream, dropped, workspaces, keep)
        if into or dropped:
            results = [into[name] if into and name in into else self._sink(name, allocate, inputs)
                       if name in dropped else allocate(inputs)
                       for name, allocate in zip(self.result_names, self.allocators)]
        else:
            results = [allocate(inputs) for allocate in self.allocators]
        pointers += [array if type(array) is int else pointer_of(array) for array in results]
        stream = self.stream_of() if stream is None else stream
        zeroing = ()
        if self.workspaces:
            if workspaces is None:
                keep = self.keeps_buffers if keep is None else keep
                kept = self.kept_scratch.get(stream) if keep and self.kept_scratch is not None else None
                # Held until the launches are queued: an allocator without a pool frees a released
                # array's memory at once, before the kernels read it.
                scratch, addresses = self._scratch(inputs, stream, keep) if kept is None or self.capturing() else kept
                pointers += addresses
            else:  # the caller's, aligned up; a zeroed one is zeroed on the stream (capturable, unlike an allocation)
                bases = [-(-address // _SCRATCH_ALIGNMENT) * _SCRATCH_ALIGNMENT for address in workspaces]
                zeroing = [(base, w.nbytes) for w, base in zip(self.workspaces, bases) if w.zeroed]
                pointers += self._addresses(bases)
        words = self.words
        with self.lock:  # the launch copies the parameter block, so it is free again after it
            for base, nbytes in zeroing:
                self.memset(base, 0, nbytes, stream)
            for slot, pointer in zip(self.slots, pointers):
                words[slot] = pointer
            if self.seed_slot is not None:
                words[self.seed_slot] = int(seed)
            if self.maps is not None:
                self.maps.point([pointers[i] for i in self.map_inputs])
            for function, (gx, gy, gz), threads, smem_bytes, argv, extended in self.launches:
                if extended is None:
                    self.launch_kernel(function, gx, gy, gz, threads, 1, 1, smem_bytes, stream, argv, 0)
                else:
                    extended(stream)
        results = tuple(results) if self.finish is None else self.finish(dict(zip(self.result_names, results)))
        if self.hands_back:
            return tuple(None if a is None else self.caller.give_back(a) for a in results)
        return results

    def _scratch(self, inputs, stream, keep):
        """The workspaces (arrays) of a call on `stream` (`inputs`: call()'s, which their allocators
        take) and their buffers' addresses in slot order. Where `keep`, a small plain workspace is
        kept per stream and reused by the plan's calls on it: the stream runs them one after
        another (a call's launches are enqueued together, under the lock), so none reads another's
        scratch, and the call spends no allocation (where every workspace is kept, it finds them
        and their addresses in kept_scratch). The rest, and every workspace of a call under graph
        capture (whose replays may run beside other calls), are allocated per call."""
        capturing = keep and self.capturing()
        result = []
        for index, w in enumerate(self.workspaces):
            kept = keep and w.keepable and not capturing
            workspace = self.scratch_by_stream.get((stream, index)) if kept else None
            if workspace is None:
                workspace = w.allocate(inputs)
                if kept:
                    if len(self.scratch_by_stream) >= _MAX_KEPT_SCRATCH:
                        self.scratch_by_stream.clear()
                        if self.kept_scratch is not None:
                            self.kept_scratch.clear()
                    self.scratch_by_stream[stream, index] = workspace
            result.append(workspace)
        addresses = self._addresses([self.pointer_of(workspace) for workspace in result])
        if capturing and self.keeps_buffers:  # CuPy's pool would hand these to later arrays while replays write them
            self.captured_scratch.append(result)
        elif keep and not capturing and self.kept_scratch is not None:
            self.kept_scratch[stream] = result, addresses
        return result, addresses

    def _addresses(self, bases):
        """The scratch buffers' addresses in slot order, from their workspaces' base addresses."""
        return [base + offset for base, offsets in zip(bases, self.scratch_offsets) for offset in offsets]

    def allocates_on(self, stream, names):
        """Whether a run on `stream` with results `names` given by address (`into`) and the plan's
        own scratch allocates: a result not among them, or scratch that is not kept for the stream."""
        return (any(name not in names for name in self.result_names)
                or any(not (self.keeps_buffers and w.keepable) or (stream, index) not in self.scratch_by_stream
                       for index, w in enumerate(self.workspaces)))

    def _sink(self, name, allocate, inputs):
        """The array of a result the caller drops: one per plan, which every such call writes (the
        writes of calls on different streams race, harmlessly: nothing reads it); a call under
        graph capture gets its own, kept for the graph's replays; torch's are not kept (its graph
        pools hold what a capture allocates)."""
        sink = self.sinks.get(name)
        if sink is None:
            sink = allocate(inputs)
            if self.keeps_buffers and not self.caller.capturing():
                self.sinks[name] = sink
            elif self.keeps_buffers:  # CuPy's pool would hand it to later arrays while replays still write it
                self.captured_scratch.append([sink])
        return sink


def _twin(output, inputs):
    """The name of an input with an output's shape and dtype, in contiguous layout (its empty_like
    is the output's cheapest allocation), or None."""
    if output.zeroed or output.scratch:
        return None
    for name, array in inputs.items():
        if (tuple(array.shape) == output.shape and _arrays.dtype_name(array) == output.dtype
                and _arrays.element_strides(array) == _contiguous_strides(output.shape)):
            return name
    return None


def _tensor_strides(strides, varlen):
    """(batch, row, head) of a q/k/v-like tensor's element strides; packed varlen tensors have no batch stride."""
    return (0, *strides[:2]) if varlen else strides[:3]


def _param_block(call, tile, strides, inputs, block_major, semaphore_blocks=0):
    """The FlashParams block without pointers; `strides` maps each (batch, seqlen, heads, headdim)
    tensor of the call (q, k, v, out, dout, dq, dk, dv) to its (batch, row, head) element strides."""
    shape, scale = call.shape, call.scale
    stats_strides = (0, shape.total_q) if shape.varlen else (shape.nheads * shape.seqlen_q, shape.seqlen_q)
    padded_rows = _padded_rows(shape, tile)
    padded_strides = (0, padded_rows) if shape.varlen else (shape.nheads * padded_rows, padded_rows)
    fields = dict(batch=shape.batch, nheads=shape.nheads, nheads_k=shape.nheads_k, seqlen_q=shape.seqlen_q,
                  seqlen_k=shape.seqlen_k, total_q=shape.total_q, total_k=shape.total_k,
                  headdim=shape.headdim, headdim_padded=tile.headdim,
                  block_major=int(block_major),
                  softmax_scale=scale, scale_log2=scale * math.log2(math.e),
                  stats_batch_stride=stats_strides[0], stats_head_stride=stats_strides[1],
                  padded_batch_stride=padded_strides[0], padded_head_stride=padded_strides[1],
                  inv_softmax_scale=1.0 / scale, dq_semaphore_blocks=semaphore_blocks)
    for name, (batch, row, head) in strides.items():
        fields.update({f"{name}_batch_stride": batch, f"{name}_row_stride": row, f"{name}_head_stride": head})
    for name, value in call.checked.items():
        option = options.by_name(name)
        if option.fill is not None and option.is_on(value):
            option.fill(fields, value, call, inputs)
    return _params.make_params(**fields)


_PADDED_ROWS = 64  # Sequence::kPaddedRows in cuda_src/common/mask.cuh


def _padded_rows(shape, tile):
    """The backward's padded rows (dq_accum, lse_log2, dout_dot_out) per head (per batch entry and
    head without varlen), for the query blocks of `tile`: every sequence starts at a multiple of 64
    (Sequence::padded_row0 in the kernels), the padding and the gaps included (a varlen sequence's
    gap is 64 rows, or 128 where the tile stores dQ^T, Tile.transposes_dq); a head's rows without
    varlen are whole query blocks, and a varlen batch keeps a gap past its last sequence's, where a
    last block of 80 or 128 rows ends."""
    pad = lambda n, unit: -(-n // unit) * unit  # noqa: E731
    if shape.varlen:
        return pad(shape.total_q, _PADDED_ROWS) + _PADDED_ROWS * (1 + tile.transposes_dq) * (shape.batch + 1)
    return pad(pad(shape.seqlen_q, tile.block_m), _PADDED_ROWS)


def _kernel(pass_, call, tile, copyable_bias=False):
    """The kernel variant of a forward or backward call on `tile`. EVEN_K where the caller's head dim
    is the tile's (the wgmma kernels have no such flag: TMA zero-fills the columns past the head dim);
    bias tiles where the attn_bias is `copyable_bias` (_copyable_bias) and the tile has room for them."""
    deterministic = pass_ == "bwd" and call.needs("deterministic")
    even_k = call.shape.headdim == tile.headdim and tile.kernel_family != _config.WGMMA
    bias_tiles = copyable_bias and tile.fits_bias_tiles(pass_, call.features, call.local)  # (never on mma.sync tiles)
    return _kernels.Kernel(pass_, call.dtype, tile, call.local, even_k, call.features, deterministic, bias_tiles)


def _tensor_maps(call, inputs, strides, boxes, kernel):
    """The TMA maps of `inputs` named in `boxes` (name -> rows per box), and of attn_bias where the
    call's `kernel` has bias tiles (_bias_map_spec), or None where the driver cannot map one (say a
    broadcast dimension's zero stride): the mma.sync kernels read any layout the plan accepts."""
    shape, varlen = call.shape, call.varlen is not None
    bias_spec = _bias_map_spec(call, inputs, kernel.tile) if kernel.bias_tiles else None
    specs = []
    for name, block in boxes.items():
        batch_stride, row_stride, head_stride = strides[name]
        array = inputs[name]
        if varlen:  # one batch entry of the packed rows (its stride is never used)
            rows, batch, batch_stride = array.shape[0], 1, array.shape[0] * row_stride
        else:
            rows, batch = array.shape[1], shape.batch
        heads = array.shape[-2]
        specs.append((call.dtype, (shape.headdim, rows, heads, batch),
                      (2 * row_stride, 2 * head_stride, 2 * batch_stride), (64, block, 1, 1)))
    names = tuple(boxes) + ("attn_bias",) * (bias_spec is not None)
    try:
        with call.caller.context():
            return _tma.Maps(specs + [bias_spec] * (bias_spec is not None),
                             [call.caller.data_pointer(inputs[name]) for name in names], names,
                             slots=len(boxes) + 1)  # (FwdMaps and BwdMaps have the bias's)
    except RuntimeError:
        return None


def _copyable_bias(call, inputs):
    """Whether the call has an attn_bias that TMA can copy into a wgmma kernel's ring of bias tiles:
    16-bit, its rows (and heads and batch entries) starting on 16-byte boundaries; the kernels'
    consumers read any other."""
    bias = inputs.get("attn_bias")
    if bias is None or _arrays.dtype_name(bias) == "float32":
        return False
    strides = options.broadcast_strides(bias.shape, _arrays.element_strides(bias))[:3]
    return not (any(2 * stride % 16 for stride in strides) or call.caller.data_pointer(bias) % 16)


def _bias_map_spec(call, inputs, tile):
    """The attn_bias's tensor map (as _tma.Maps takes it) for a kernel on `tile` with bias tiles (a
    _copyable_bias). Keys, rows, heads, batch: a broadcast dimension has size 1 (broadcast rows:
    boxes of one row, which the consumers add to every row)."""
    bias = inputs["attn_bias"]
    batch, head, row = options.broadcast_strides(bias.shape, _arrays.element_strides(bias))[:3]
    shape = call.shape
    unstepped = -(-2 * shape.seqlen_k // 16) * 16 * shape.seqlen_q  # (a size-1 dimension's: a whole matrix's)
    dims = (shape.seqlen_k, shape.seqlen_q if row else 1, shape.nheads if head else 1, shape.batch if batch else 1)
    return (call.dtype, dims, tuple(2 * stride or unstepped for stride in (row, head, batch)),
            (64, tile.block_m if row else 1, 1, 1))


def _bias_box_rows(maps):
    """FlashParams.bias_box_rows of a plan with these tensor maps: the rows of the attn_bias map's
    boxes where it has one (_bias_map_spec), else 0 (the kernel reads the bias itself, or none)."""
    if maps is None or "attn_bias" not in maps.inputs:
        return 0
    return maps.specs[maps.inputs.index("attn_bias")][3][1]


def _forward_plan(call, inputs, return_dbias):
    shape, varlen = call.shape, call.varlen is not None
    q = inputs["q"]
    strides = {name: _tensor_strides(_arrays.element_strides(inputs[name]), varlen) for name in ("q", "k", "v")}
    strides["out"] = _tensor_strides(_contiguous_strides(q.shape), varlen)
    if _schedule.kernel_family("fwd", call.caller.device_id, shape.headdim) == _config.WGMMA:
        plan = _wgmma_forward_plan(call, inputs, strides)
        if plan is not None:
            return plan
    tile = _schedule.tile("fwd", shape.headdim, call.caller.device_id)
    kernel = _kernel("fwd", call, tile)
    # A one-stage forward waits for each block's K and V. Block-major, the CTAs running at once
    # read the K and V of all of a batch entry's heads, so there they must fit in L2 (hd256 at 16k
    # is 128 MiB, and runs slower block-major than head-major).
    l2_bytes = _schedule.device_attributes(call.caller.device_id)["L2CacheSize"]
    kv_fits_l2 = 2 * shape.nheads_k * shape.seqlen_k * tile.headdim * 2 <= l2_bytes
    grid, block_major = _schedule.block_grid(-(-shape.seqlen_q // tile.block_m), shape.nheads, shape.batch,
                                             call.local and (tile.stages == 2 or kv_fits_l2))
    outputs = [_Output("out", tuple(q.shape), call.dtype), _Output("lse", shape.stats, "float32")]
    return Plan(call.caller, _param_block(call, tile, strides, inputs, block_major), inputs, outputs,
                [_Launch(kernel, grid)])


def _wgmma_forward_plan(call, inputs, strides):
    """The forward on the wgmma kernels, or None where the driver cannot map an input for TMA."""
    shape = call.shape
    copyable_bias = _copyable_bias(call, inputs)
    table = _config.forward_table(shape.headdim, shape.seqlen_q, call.local, copyable_bias, call.features)
    tile = _schedule.tile(table, shape.headdim, call.caller.device_id, _config.WGMMA)
    kernel = _kernel("fwd", call, tile, copyable_bias)
    maps = _tensor_maps(call, inputs, strides, {"q": tile.block_m, "k": tile.block_n, "v": tile.block_n}, kernel)
    if maps is None:
        return None
    # Persistent: a CTA per SM (one fits), taking tiles in turn (fwd_tile in cuda_src/sm90/fwd.cuh).
    m_blocks = -(-shape.seqlen_q // tile.block_m)
    tiles = m_blocks * shape.nheads * shape.batch
    attributes = _schedule.device_attributes(call.caller.device_id)
    grid = (min(tiles, attributes["MultiProcessorCount"]), 1, 1)
    _, block_major = _schedule.block_grid(m_blocks, shape.nheads, shape.batch, call.local)  # the tiles' order
    outputs = [_Output("out", tuple(inputs["q"].shape), call.dtype), _Output("lse", shape.stats, "float32")]
    if block_major:  # as groups of (batch entry, head) pairs
        pairs = shape.nheads * shape.batch
        kv_bytes_per_pair = 2 * shape.seqlen_k * tile.headdim * 2 * shape.nheads_k // shape.nheads
        counter = tile.takes_tiles_from_counter(call.local)
        block_major = _schedule.tile_group(pairs, kv_bytes_per_pair, attributes["L2CacheSize"], grid[0],
                                           _schedule.COUNTER_GROUP_L2_SHARE[tile.headdim] if counter else None)
        if counter and block_major < pairs:  # the CTAs take tiles from a counter (next_tile in cuda_src/sm90/fwd.cuh)
            outputs.append(_Output("tile_counter", (1,), "int32", zeroed=True, scratch=True))
    params = _param_block(call, tile, strides, inputs, block_major)
    params["bias_box_rows"] = _bias_box_rows(maps)
    return Plan(call.caller, params, inputs, outputs, [_Launch(kernel, grid)], maps=maps)


def dq_stored_by_bwd(call, tile):
    """Whether the backward of `call` on `tile` stores dq from its own kernel: where the keys are one
    block, each step computes a query block's whole dQ (FlashParams.dq_stored_by_bwd), so there is no
    dq_accum to add into and no bwd_convert_dq to launch (a launch fewer, which the small calls whose
    time is the host's feel most). The wgmma tiles whose consumers hold dQ in rows only
    (Tile.can_store_dq: the mma.sync kernels spill with a second way out beside their adds). The
    stores (16-byte rows through shared memory) cost a step less than the adds at every step count a
    CTA (1 to 64 measured on the H100, bench/notes/v90-dq-row-stores.md), so a CTA's step count
    doesn't enter."""
    return tile.can_store_dq and call.shape.seqlen_k <= tile.block_n


def _backward_plan(call, inputs, return_dbias):
    shape, varlen, device_id = call.shape, call.varlen is not None, call.caller.device_id
    table = _kernels.backward_table(call.features, call.needs("deterministic"))
    wgmma_tables = _config.TILES[_config.WGMMA]["sm90"]
    if (table in ("bwd", "bwd_deterministic") and not call.local
            and _config.padded_headdim(shape.headdim, tuple(wgmma_tables["bwd"])) in wgmma_tables["bwd_full"]
            and _schedule.kernel_family("bwd_full", device_id, shape.headdim) == _config.WGMMA):
        table = "bwd_full"
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    strides = {name: _tensor_strides(_arrays.element_strides(inputs[name]), varlen)
               for name in ("dout", "q", "k", "v", "out")}
    strides.update({name: _tensor_strides(_contiguous_strides(like.shape), varlen)
                    for name, like in (("dq", q), ("dk", k), ("dv", v))})
    maps = None
    if _schedule.kernel_family(table, device_id, shape.headdim) == _config.WGMMA:
        tile = _schedule.tile(table, shape.headdim, device_id, _config.WGMMA)
        kernel = _kernel("bwd", call, tile, _copyable_bias(call, inputs))
        maps = _tensor_maps(call, inputs, strides, {"q": tile.block_m, "k": tile.block_n, "v": tile.block_n,
                                                    "dout": tile.block_m}, kernel)
    if maps is None:  # the mma.sync kernels ('bwd_full' is wgmma's alone)
        tile = _schedule.tile("bwd" if table == "bwd_full" else table, shape.headdim, device_id)
        kernel = _kernel("bwd", call, tile)
    padded = (*shape.stats[:-1], _padded_rows(shape, tile))
    outputs = [_Output("dq", tuple(q.shape), call.dtype), _Output("dk", tuple(k.shape), call.dtype),
               _Output("dv", tuple(v.shape), call.dtype), _Output("dout_dot_out", padded, "float32", scratch=True),
               _Output("lse_log2", padded, "float32", scratch=True)]
    stores_dq = dq_stored_by_bwd(call, tile)
    if not stores_dq:
        outputs.append(_Output("dq_accum", (*padded, tile.headdim), "float32", scratch=True))  # zeroed by bwd_dot
    semaphore_blocks = 0
    if call.needs("deterministic"):
        semaphore_blocks = -(-shape.seqlen_q // tile.block_m)
        outputs.append(_Output("dq_semaphore", (shape.batch * shape.nheads * semaphore_blocks,), "int32", True, True))
    finish = None  # the results are (dq, dk, dv)
    grid, block_major = _schedule.block_grid(-(-shape.seqlen_k // tile.block_n), shape.nheads_k, shape.batch,
                                             call.local)
    if block_major and kernel.wgmma:  # (batch, kv head) pairs in groups whose rows fit the L2 (grid_slot in common/mask.cuh)
        pairs = shape.batch * shape.nheads_k
        bytes_per_pair = shape.nheads // shape.nheads_k * shape.seqlen_q * tile.headdim * (2 + 2 + 4)
        attributes = _schedule.device_attributes(device_id)
        group = _schedule.pair_group(shape.batch, shape.nheads_k, bytes_per_pair, attributes["L2CacheSize"],
                                     pairs * grid[1], attributes["MultiProcessorCount"])
        if pairs // group <= MAX_GRID_YZ:
            grid = (group, grid[1], pairs // group)
    params = _param_block(call, tile, strides, inputs, block_major, semaphore_blocks)
    params["bias_box_rows"] = _bias_box_rows(maps)
    if tile.transposes_dq:  # dq_accum in dQ^T's fragment order
        params["dq_accum_fragment_rows"] = tile.block_m
    if not (call.local or kernel.options or kernel.deterministic or varlen or kernel.wgmma):  # those that may split (sm80/bwd.cuh, kMaySplit)
        grid = _split_last_wave(kernel, call.caller.device(), shape, grid, params, outputs)
    if return_dbias:
        finish = _add_dbias(call, kernel, params, outputs, inputs.get(options.DIFFERENTIABLE))
    row_grid = (-(-shape.seqlen_q // _kernels.ROW_KERNEL_ROWS), shape.nheads, shape.batch)
    launches = [_Launch(_kernels.Kernel("bwd_dot", call.dtype), row_grid), _Launch(kernel, grid)]
    params["dq_stored_by_bwd"] = int(stores_dq)
    if not stores_dq:
        launches.append(_Launch(_kernels.Kernel("bwd_convert_dq", call.dtype), row_grid))
    return Plan(call.caller, params, inputs, outputs, launches, finish, maps)


def _split_last_wave(kernel, device, shape, grid, params, outputs):
    """The grid of a plain backward whose last partial wave is split (TailSplit in the kernel;
    `params` and `outputs` get the split's fields and buffers), or `grid` where it is not."""
    blocks, heads_k, batch = grid
    tile = kernel.tile
    steps = shape.nheads // heads_k * -(-shape.seqlen_q // tile.block_m)
    tail_units, tail_parts = _schedule.tail_split(blocks * heads_k * batch, steps,
                                                  _schedule.resident_ctas(kernel, device))
    extra_z = -(-tail_units * tail_parts // (blocks * heads_k))  # the pieces' z slices
    if not tail_units or batch + extra_z > MAX_GRID_YZ or (batch + extra_z) * blocks * heads_k >= 2 ** 31:
        return grid
    params["tail_units"], params["tail_parts"] = tail_units, tail_parts
    outputs += [_Output("dkv_accum", (tail_units * 2 * tile.block_n * tile.headdim,), "float32", True, True),
                _Output("tail_pieces_done", (tail_units,), "int32", True, True)]
    return blocks, heads_k, batch + extra_z


def _add_dbias(call, kernel, params, outputs, bias):
    """Adds dbias to a backward plan of `kernel`; returns its finish: (dq, dk, dv, dbias).

    A bias that is not broadcast gets its gradient straight from the kernel, in its own dtype: each
    element has one writer (where a causal or window mask skips blocks, the wgmma kernels zero their
    rows where they start on 16-byte boundaries, zero_unseen_dbias in cuda_src/sm90/bwd.cuh; else it
    is zeroed first). A broadcast one's dS goes into a zeroed float32 array with stride 0 along the
    broadcast dimensions, added by atomics; where a deterministic backward would have them collide,
    or only the rows are broadcast (the kernels add by atomics along a zero batch or head stride),
    the kernel writes the full (batch, nheads, seqlen_q, seqlen_k) instead, summed afterwards in a
    fixed order (common/score.cuh, BiasGradient)."""
    if bias is None:
        return lambda o: (o["dq"], o["dk"], o["dv"], None)
    shape = call.shape
    full = (shape.batch, shape.nheads, shape.seqlen_q, shape.seqlen_k)
    bias4 = (1,) * (4 - len(bias.shape)) + tuple(bias.shape)
    bias_dtype, bias_shape, caller = _arrays.dtype_name(bias), tuple(bias.shape), call.caller
    direct = bias4 == full
    rows_alone = bias4[2] < full[2] and bias4[:2] == full[:2]
    dbias_shape = full if direct or rows_alone or call.needs("deterministic") else bias4
    # Stride 0 along the dimensions the bias is broadcast over, and only there: a size-1 dimension of
    # the call itself keeps its stride (one writer per element, and the output is not zeroed).
    strides = tuple(0 if size < want else stride
                    for size, want, stride in zip(dbias_shape, full, _contiguous_strides(dbias_shape)))
    params["dbias_batch_stride"], params["dbias_head_stride"], params["dbias_row_stride"] = strides[:3]
    dbias_is_float32 = not direct or bias_dtype == "float32"
    params["dbias_is_float32"] = int(dbias_is_float32)
    row_bytes = shape.seqlen_k * (4 if dbias_is_float32 else 2)
    zero_unseen = call.local and kernel.wgmma and dbias_shape == full and row_bytes % 16 == 0
    params["dbias_zero_unseen"] = int(zero_unseen)
    zeroed = dbias_shape != full or (call.local and not zero_unseen)  # (a broadcast one: atomics add into it)
    if direct:
        outputs.append(_Output("dbias", full, bias_dtype, zeroed))
        return lambda o: (o["dq"], o["dk"], o["dv"], o["dbias"].reshape(bias_shape))
    outputs.append(_Output("dbias", dbias_shape, "float32", zeroed))
    axes = tuple(axis for axis in range(4) if dbias_shape[axis] != bias4[axis])
    return lambda o: (o["dq"], o["dk"], o["dv"], caller.reduce(o["dbias"], axes, bias_shape, bias_dtype))
