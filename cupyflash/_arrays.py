"""Arrays in and out: CuPy, PyTorch, JAX (or any CUDA DLPack producer), and NumPy.

The kernels take raw device pointers: torch tensors and CuPy arrays are launched on as they are,
other GPU arrays (JAX, any DLPack producer) are viewed as CuPy arrays through DLPack, without
copies. Work is issued on the caller's current stream (PyTorch's current stream for torch tensors,
CuPy's otherwise), and results are handed back in the caller's kind: torch outputs are allocated by
torch's allocator, JAX outputs are CuPy buffers that JAX adopts through DLPack.
"""

import contextlib
import dataclasses
import functools
import operator

import numpy

_DLPACK_CUDA, _DLPACK_CUDA_MANAGED = 2, 13  # DLPack device types that are GPU memory


def gpu_available():
    """Whether CuPy sees a CUDA device (no CuPy, no driver or no device all mean no)."""
    try:
        import cupy
        return cupy.cuda.is_available()
    except Exception:
        return False


# What is missing, as one line naming the pip extra that brings it. Every command and the compile
# workers report a missing piece through these, so each hint is written once.

class SetupError(RuntimeError):
    """A missing piece of the installation; the message is a one-line hint, shown without a traceback."""


def _cuda_extra():
    """The extra of the installed CuPy wheel ('cuda12' or 'cuda13'): its NVRTC wheel matches it."""
    from cupy.cuda import runtime
    return f"cuda{runtime.runtimeGetVersion() // 1000}"


def _cuda_version(code):
    return f"{code // 1000}.{code % 1000 // 10}"


def missing_cupy():
    """None when CuPy imports; otherwise the hint."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return 'CuPy is not installed: pip install -e ".[cuda13]" (or ".[cuda12]" for a CUDA 12 driver)'
    return None


def missing_nvrtc():
    """None when CuPy loads NVRTC (which compiles the kernels, GPU or not); otherwise the hint."""
    hint = missing_cupy()
    if hint:
        return hint
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception:
        extra = _cuda_extra()
        return (f"NVRTC, the CUDA runtime compiler, is not installed (CuPy found no libnvrtc.so.{extra[4:]}): "
                f'pip install -e ".[{extra}]"')
    return None


def missing_gpu():
    """None when CuPy sees a CUDA device; otherwise the hint (NumPy inputs still run the reference)."""
    hint = missing_cupy()
    if hint:
        return hint
    from cupy.cuda import runtime
    try:
        if runtime.getDeviceCount() > 0:
            return None
        error = "no device"
    except Exception as exc:  # CUDARuntimeError: no driver, a driver too old for this CuPy, ...
        error = str(exc)
    try:
        driver, needed = runtime.driverGetVersion(), runtime.runtimeGetVersion()
    except Exception:
        driver, needed = 0, 0
    if driver == 0:
        return "no GPU (no NVIDIA driver is loaded): NumPy inputs run the float64 reference"
    if driver // 1000 < needed // 1000 or "InsufficientDriver" in error:
        # A CUDA runtime runs on any driver of its major version; the oldest wheel is for CUDA 12.
        wheel = f"cupy-cuda{needed // 1000}x"
        fix = (f'pip uninstall -y {wheel} && pip install -e ".[cuda{driver // 1000}]"' if driver >= 12000
               else "install an NVIDIA driver for CUDA 12 or newer")
        return (f"the NVIDIA driver supports CUDA {_cuda_version(driver)}, older than the CUDA {needed // 1000} "
                f"that {wheel} needs: {fix}")
    return (f"no GPU visible to CuPy (driver for CUDA {_cuda_version(driver)}: {error}; "
            f"is CUDA_VISIBLE_DEVICES set?)")


def kind_of(array):
    """'numpy', 'cupy', 'torch', 'jax' or 'dlpack' (another DLPack producer); None otherwise."""
    return kind_of_type(type(array))


@functools.cache
def kind_of_type(cls):
    """kind_of for an array type (cached: the launch path asks on every call)."""
    if issubclass(cls, numpy.ndarray):
        return "numpy"
    module = cls.__module__.split(".")[0]
    if module in ("cupy", "torch"):
        return module
    if module in ("jax", "jaxlib"):
        return "jax"
    if hasattr(cls, "__dlpack__") and hasattr(cls, "__dlpack_device__"):
        return "dlpack"
    return None


def dlpack_device(array):
    """(device type, device id) as DLPack reports it."""
    kind = kind_of(array)
    if kind == "cupy":
        return _DLPACK_CUDA, array.device.id
    device_type, device_id = array.__dlpack_device__()
    return int(device_type), int(device_id)


def is_on_gpu(array):
    return dlpack_device(array)[0] in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED)


ANCHOR = "q"  # an array every launch plan's call has (a backward's too), on the call's device


@dataclasses.dataclass(frozen=True)
class Caller:
    """The kind of arrays a call came with, its device, and how the launch path treats them.

    The kernels launch on raw pointers. torch tensors and CuPy arrays are used as they are; other
    GPU arrays (JAX, any DLPack producer) are viewed as CuPy arrays first (`launchable`) and their
    outputs are CuPy arrays handed back through DLPack (`give_back`)."""
    kind: str
    device_id: int

    @property
    def allocates_with_torch(self):
        return self.kind == "torch"

    def device(self):
        """A context that makes the caller's device current (CuPy's allocations and launches)."""
        import cupy
        return cupy.cuda.Device(self.device_id)

    @contextlib.contextmanager
    def context(self):
        """device(), with the device's primary context current on this thread: driver calls (tensor
        map encoding, module loads) fail without one, and a thread whose first CUDA call this is
        (autograd's backward thread) has none, since cupy.cuda.Device skips setting the device it
        reads as current."""
        import cupy
        with self.device():
            cupy.cuda.runtime.setDevice(self.device_id)
            yield

    def launchable(self, array):
        """`array` as the launch path takes it: torch tensors and CuPy arrays as they are, the rest
        viewed as CuPy arrays through DLPack."""
        if self.kind in ("torch", "cupy"):
            return array
        import cupy
        return cupy.from_dlpack(array)

    def data_pointer(self, array):
        """The device address of the first element of a launchable array."""
        return self.pointer_reader()(array)

    def pointer_reader(self):
        """data_pointer as a function of the array alone (for launch plans)."""
        if self.allocates_with_torch:
            import torch
            return torch.Tensor.data_ptr
        return operator.attrgetter("data.ptr")

    def stream_reader(self):
        """stream_pointer as a function of no arguments, resolved once (for launch plans)."""
        if self.allocates_with_torch:
            import torch
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the handle alone, no Stream object
            if raw:
                return functools.partial(raw, self.device_id)
            return lambda: torch.cuda.current_stream(self.device_id).cuda_stream
        import cupy
        return lambda: cupy.cuda.get_current_stream().ptr

    def stream_pointer(self):
        """The stream to launch on: PyTorch's current stream for torch callers, CuPy's otherwise."""
        return self.stream_reader()()

    def capturing(self):
        """Whether the stream of stream_pointer() is capturing a CUDA graph."""
        return self.capture_reader()()

    def capture_reader(self):
        """capturing as a function of no arguments, resolved once (for launch plans)."""
        if self.allocates_with_torch:
            import torch
            return getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
        import cupy
        return lambda: cupy.cuda.get_current_stream().is_capturing()

    def allocator(self, shape, dtype, zeroed=False, twin=None, anchor=0):
        """A function of a call's inputs (a sequence) that returns a new GPU array (zero-filled if
        `zeroed`): torch's allocator for torch callers, CuPy's otherwise. The dtype and device are
        resolved once, for launch plans that allocate on every call. For torch, `twin` is the
        position of an input of the same shape and dtype in contiguous layout, whose empty_like is
        torch's cheapest allocation; without one the result is made by new_empty from the input at
        `anchor`, which carries the device."""
        if self.allocates_with_torch:
            import torch
            if twin is not None:
                like = torch.zeros_like if zeroed else torch.empty_like
                return lambda inputs: like(inputs[twin])
            torch_dtype = getattr(torch, dtype)
            if zeroed:
                return lambda inputs: inputs[anchor].new_zeros(shape, dtype=torch_dtype)
            return lambda inputs: inputs[anchor].new_empty(shape, dtype=torch_dtype)
        import cupy
        make = functools.partial(cupy.zeros if zeroed else cupy.empty, shape,
                                 bfloat16_dtype() if dtype == "bfloat16" else numpy.dtype(dtype))
        return lambda inputs: make()

    def zeros(self, shape, dtype):
        """A new zero-filled GPU array (torch's allocator for torch callers, CuPy's otherwise), on
        the caller's stream."""
        if self.allocates_with_torch:
            import torch
            return torch.zeros(shape, dtype=getattr(torch, dtype), device=torch.device("cuda", self.device_id))
        return self.allocator(shape, dtype, zeroed=True)(None)

    def reduce(self, array, axes, shape, dtype):
        """array summed over `axes` (in a fixed order), reshaped to `shape`, cast to `dtype`."""
        if axes:
            array = array.sum(axes, keepdims=True) if not self.allocates_with_torch else array.sum(axes, keepdim=True)
        array = array.reshape(shape)
        if self.allocates_with_torch:
            import torch
            return array.to(getattr(torch, dtype))
        return array.astype(bfloat16_dtype() if dtype == "bfloat16" else dtype)

    def give_back(self, array):
        """The caller's kind of array for an output made by `empty`."""
        if self.kind in ("torch", "cupy"):
            return array
        if self.kind == "jax":
            import jax
            return jax.dlpack.from_dlpack(array)
        return array  # another DLPack producer: a CuPy array, itself a DLPack producer




class _StreamHandle:
    """The CUDA stream protocol (`__cuda_stream__`) for a raw CUstream."""
    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr


_streams = {}  # (CUstream, device) -> CuPy's stream object for it


def external_stream(ptr, device_id):
    """CuPy's stream object for a raw CUstream (XLA's, torch's), to make it CuPy's current one."""
    stream = _streams.get((ptr, device_id))
    if stream is None:
        import cupy
        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14 deprecates ExternalStream
            stream = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        else:
            stream = cupy.cuda.ExternalStream(ptr, device_id)
        if len(_streams) >= 64:
            _streams.clear()
        _streams[ptr, device_id] = stream
    return stream


def to_host(array, caller):
    """A NumPy copy of a small array (waits for the work that computes it)."""
    if caller.kind == "numpy":
        return array
    if caller.kind == "torch":
        return array.cpu().numpy()
    import cupy
    return cupy.asnumpy(caller.launchable(array))


def bfloat16_dtype():
    """NumPy's bfloat16 (from ml_dtypes, which CuPy also uses for bfloat16 arrays)."""
    import ml_dtypes
    return numpy.dtype(ml_dtypes.bfloat16)


def dtype_name(array):
    """'float16', 'bfloat16', 'float32', ... for any supported array kind."""
    name = str(array.dtype)
    return name.replace("torch.", "").rsplit(".", 1)[-1]


def element_strides(array):
    """Strides in elements for NumPy, CuPy and torch arrays; None for other producers (JAX, DLPack),
    whose strides are known only once they are viewed through DLPack."""
    kind = kind_of(array)
    if kind in ("numpy", "cupy"):
        return tuple(s // array.itemsize for s in array.strides)
    if kind == "torch":
        return tuple(array.stride())
    return None
