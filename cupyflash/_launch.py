"""Programmatic dependent launches, through the driver's cuLaunchKernelEx (ctypes on libcuda: CuPy
binds only cuLaunchKernel).

On compute capability 9.0 and newer a kernel launched so may start while the kernel before it in
the stream still runs, once that kernel's blocks allow it (`allow_dependent_grid`,
cuda_src/common/ptx.cuh); it waits in `wait_for_prior_grid` until that kernel has finished. Its
launch and block placement then overlap the other's tail: worth it where a kernel lasts a few
microseconds, as a decode step's combine does.
"""

import ctypes
import functools

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _Attribute(ctypes.Structure):
    """CUlaunchAttribute: an id, then a 64-byte value union at offset 8 (here: its first int)."""
    _fields_ = [("id", ctypes.c_int), ("_pad", ctypes.c_int), ("value", ctypes.c_int), ("_rest", ctypes.c_int),
                ("_union", ctypes.c_uint64 * 7)]


class _Config(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(_Attribute)),
                ("attribute_count", ctypes.c_uint)]


@functools.cache
def _launch_kernel_ex():
    """The driver's cuLaunchKernelEx, or None where it has none (drivers before CUDA 12)."""
    try:
        function = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


def available(compute_capability):
    """Whether kernels on a device of this compute capability ((major, minor)) can be launched as
    dependent launches."""
    return tuple(compute_capability) >= (9, 0) and _launch_kernel_ex() is not None


class DependentLaunch:
    """One kernel's dependent launch: called with a stream (a CUstream handle), it queues `function`
    with the arguments at `argv` (a void*[] address)."""

    def __init__(self, function, grid, threads, shared_bytes, argv):
        self.attribute = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self.config = _Config(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(threads, 1, 1),
                              shared_bytes=shared_bytes, attributes=ctypes.pointer(self.attribute), attribute_count=1)
        self.config_address, self.function, self.argv = ctypes.addressof(self.config), function, argv
        self.launch_kernel_ex = _launch_kernel_ex()

    def __call__(self, stream):
        self.config.stream = stream
        status = self.launch_kernel_ex(self.config_address, self.function, self.argv, None)
        if status:
            import cupy
            raise cupy.cuda.driver.CUDADriverError(status)
