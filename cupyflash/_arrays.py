"""Arrays in and out: CuPy, PyTorch, JAX (or any CUDA DLPack producer), and NumPy.

GPU inputs are viewed as CuPy arrays through DLPack, without copies. Work is issued on the
caller's current stream (PyTorch's current stream for torch tensors, CuPy's otherwise), and
results are handed back in the caller's kind: torch outputs are allocated by torch's allocator,
JAX outputs are CuPy buffers that JAX adopts through DLPack.
"""

import contextlib
import dataclasses

import numpy

_DLPACK_CUDA, _DLPACK_CUDA_MANAGED = 2, 13  # DLPack device types that are GPU memory


def gpu_available():
    """Whether CuPy sees a CUDA device (no CuPy, no driver or no device all mean no)."""
    try:
        import cupy
        return cupy.cuda.is_available()
    except Exception:
        return False


def kind_of(array):
    """'numpy', 'cupy', 'torch', 'jax' or 'dlpack' (another DLPack producer); None otherwise."""
    if isinstance(array, numpy.ndarray):
        return "numpy"
    module = type(array).__module__.split(".")[0]
    if module in ("cupy", "torch"):
        return module
    if module in ("jax", "jaxlib"):
        return "jax"
    if hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__"):
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


@dataclasses.dataclass
class Caller:
    """The kind of arrays a call came with, its device, and how results go back."""
    kind: str
    device_id: int

    @contextlib.contextmanager
    def on_stream(self):
        """Makes the caller's current stream CuPy's current stream for the duration."""
        import cupy
        with cupy.cuda.Device(self.device_id):
            if self.kind == "torch":
                import torch
                torch_stream = torch.cuda.current_stream(self.device_id)
                if hasattr(torch_stream, "__cuda_stream__") and hasattr(cupy.cuda.Stream, "from_external"):
                    stream = cupy.cuda.Stream.from_external(torch_stream)
                else:
                    stream = cupy.cuda.ExternalStream(torch_stream.cuda_stream, self.device_id)
                with stream:
                    yield
            else:
                yield

    def to_cupy(self, array):
        import cupy
        return array if self.kind == "cupy" else cupy.from_dlpack(array)

    def empty(self, shape, dtype):
        """A new array of the caller's kind, and a CuPy view of the same memory."""
        import cupy
        if self.kind == "torch":
            import torch
            torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
            native = torch.empty(shape, dtype=torch_dtype[numpy.dtype(dtype).name], device=f"cuda:{self.device_id}")
            return native, cupy.from_dlpack(native)
        array = cupy.empty(shape, dtype=dtype)
        return array, array

    def give_back(self, native):
        """The caller's kind of array for an output made by `empty`."""
        if self.kind == "jax":
            import jax
            return jax.dlpack.from_dlpack(native)
        return native


def bfloat16_dtype():
    """NumPy's bfloat16 (from ml_dtypes, which CuPy also uses for bfloat16 arrays)."""
    import ml_dtypes
    return numpy.dtype(ml_dtypes.bfloat16)


def dtype_name(array):
    """'float16', 'bfloat16', 'float32', ... for any supported array kind."""
    name = str(array.dtype)
    return name.replace("torch.", "").rsplit(".", 1)[-1]
