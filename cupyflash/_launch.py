"""Launches with attributes, through the driver's cuLaunchKernelEx (ctypes on libcuda: CuPy binds only
cuLaunchKernel), on compute capability 9.0 and newer:

- programmatic dependent launches: the kernel may start while the kernel before it in the stream
  still runs, once that kernel's blocks allow it (`allow_dependent_grid`, cuda_src/common/ptx.cuh);
  it waits in `wait_for_prior_grid` until that kernel has finished. Its launch and block placement
  then overlap the other's tail: worth it where a kernel lasts a few microseconds, as a decode
  step's combine does;
- thread-block clusters: groups of CTAs (consecutive along x) placed together, which read each
  other's shared memory (a decode step's splits, merged without a combine launch).
"""

import ctypes
import functools

_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: value (x, y, z)
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: value 1
MAX_CLUSTER = 8  # CTAs a cluster may hold on every device that has clusters (the portable size)


class _Attribute(ctypes.Structure):
    """CUlaunchAttribute: an id, then a 64-byte value union at offset 8 (here: its first ints)."""
    _fields_ = [("id", ctypes.c_int), ("_pad", ctypes.c_int), ("value", ctypes.c_uint * 16)]


class _Config(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(_Attribute)),
                ("attribute_count", ctypes.c_uint)]


@functools.cache
def _driver(name, pointers):
    """The driver's function `name`, of `pointers` pointer arguments, or None where it has none
    (drivers before CUDA 12)."""
    try:
        function = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p] * pointers
    function.restype = ctypes.c_int
    return function


def available(compute_capability):
    """Whether kernels on a device of this compute capability ((major, minor)) can be launched as
    dependent launches and in clusters."""
    return tuple(compute_capability) >= (9, 0) and _driver("cuLaunchKernelEx", 4) is not None


class ExtendedLaunch:
    """One kernel's launch with attributes: a dependent launch, and/or CTAs in clusters of `cluster`
    along x. Called with a stream (a CUstream handle), it queues `function` with the arguments at
    `argv` (a void*[] address)."""

    def __init__(self, function, grid, threads, shared_bytes, argv, dependent=False, cluster=1):
        values = ([(_PROGRAMMATIC_STREAM_SERIALIZATION, (1,))] if dependent else []) + (
            [(_CLUSTER_DIMENSION, (cluster, 1, 1))] if cluster > 1 else [])
        self.attributes = (_Attribute * len(values))()
        for attribute, (id_, value) in zip(self.attributes, values):
            attribute.id = id_
            attribute.value[:len(value)] = value
        self.config = _Config(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(threads, 1, 1),
                              shared_bytes=shared_bytes, attributes=self.attributes, attribute_count=len(values))
        self.config_address, self.function, self.argv = ctypes.addressof(self.config), function, argv
        self.launch_kernel_ex = _driver("cuLaunchKernelEx", 4)

    def __call__(self, stream):
        self.config.stream = stream
        status = self.launch_kernel_ex(self.config_address, self.function, self.argv, None)
        if status:
            import cupy
            raise cupy.cuda.driver.CUDADriverError(status)


def max_active_clusters(function, threads, shared_bytes, cluster):
    """How many clusters of `cluster` CTAs of `function` (a CUfunction handle) the device runs at
    once (cuOccupancyMaxActiveClusters): fewer than its SMs over the cluster size, where a cluster
    must fit in one GPC (an H200's 132 SMs hold 15 clusters of 8 one-CTA-per-SM CTAs, 30 of 4)."""
    count = ctypes.c_int(0)
    launch = ExtendedLaunch(function, (cluster, 1, 1), threads, shared_bytes, None, cluster=cluster)
    status = _driver("cuOccupancyMaxActiveClusters", 3)(ctypes.addressof(count), function, launch.config_address)
    if status:
        import cupy
        raise cupy.cuda.driver.CUDADriverError(status)
    return count.value
