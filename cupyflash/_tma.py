"""Tensor maps for the tensor memory accelerator (sm_90): the driver's cuTensorMapEncodeTiled,
through ctypes on libcuda (CuPy does not bind it), giving the 128 bytes that a kernel takes by
value as a __grid_constant__ TensorMap (cuda_src/sm90/tma.cuh)."""

import ctypes
import functools

import numpy

_DATA_TYPES = {"uint8": 0, "float16": 6, "float32": 7, "bfloat16": 9}  # CUtensorMapDataType
_SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}  # CUtensorMapSwizzle, by the swizzle's span in bytes
_L2_PROMOTION_128B = 2
_MAP_BYTES, _MAP_ALIGNMENT = 128, 64


@functools.cache
def _encode_tiled():
    function = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def encode_tiled(address, dtype, dims, strides_bytes, box, swizzle_bytes=128):
    """The bytes of a CUtensorMap of the tensor at device `address`: `dims` its sizes in elements,
    innermost first; `strides_bytes` the byte strides of every dimension but the innermost (which
    is contiguous; each a multiple of 16); copied in boxes of `box` elements (the innermost box
    side at most `swizzle_bytes` bytes when swizzled). Out-of-range elements of a box read as zero."""
    rank = len(dims)
    if not (len(strides_bytes) == rank - 1 and len(box) == rank and 1 <= rank <= 5):
        raise ValueError(f"a tensor map takes 1 to 5 dims with one stride fewer and a box side each; got dims "
                         f"{dims}, strides {strides_bytes}, box {box}")
    storage = ctypes.create_string_buffer(_MAP_BYTES + _MAP_ALIGNMENT)
    aligned = ctypes.addressof(storage) + (-ctypes.addressof(storage)) % _MAP_ALIGNMENT  # the driver wants 64
    status = _encode_tiled()(
        aligned, _DATA_TYPES[dtype], rank, address, (ctypes.c_uint64 * rank)(*dims),
        (ctypes.c_uint64 * max(rank - 1, 1))(*strides_bytes), (ctypes.c_uint32 * rank)(*box),
        (ctypes.c_uint32 * rank)(*([1] * rank)), 0, _SWIZZLES[swizzle_bytes], _L2_PROMOTION_128B, 0)
    if status:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for a {dtype} tensor of dims {dims}, "
                           f"strides {strides_bytes} bytes, box {box}, {swizzle_bytes}-byte swizzle")
    return ctypes.string_at(aligned, _MAP_BYTES)


@functools.cache
def address_word():
    """Which 8-byte word of an encoded map holds the tensor's address verbatim (found by encoding
    one map at two addresses), or None if no word does: then maps are encoded again per call."""
    def words(address):
        return numpy.frombuffer(encode_tiled(address, "float16", (64, 256), (128,), (64, 64)), numpy.uint64)
    first, second = 1 << 20, 3 << 24
    a, b = words(first), words(second)
    differ = numpy.flatnonzero(a != b)
    if len(differ) == 1 and a[differ[0]] == first and b[differ[0]] == second:
        return int(differ[0])
    return None


class Maps:
    """The tensor maps of a plan's inputs, one after another in the buffer a kernel receives as its
    second parameter; `point(addresses)` aims them at a call's arrays.

    `specs` gives each map's (dtype, dims, strides_bytes, box) as encode_tiled takes them, `inputs`
    the names of the arrays they map; the maps are encoded once, at `addresses`, and later only
    their address word is rewritten (or, where the driver's layout hides it, each map is encoded
    again). The buffer holds `slots` maps (the kernel's struct of them; default one per spec), those
    past the specs zero."""

    def __init__(self, specs, addresses, inputs, slots=None):
        self.specs, self.inputs = specs, inputs
        slots = len(specs) if slots is None else slots
        self.storage = ctypes.create_string_buffer(_MAP_BYTES * slots + _MAP_ALIGNMENT)
        self.address = ctypes.addressof(self.storage) + (-ctypes.addressof(self.storage)) % _MAP_ALIGNMENT
        self.words = (ctypes.c_uint64 * (_MAP_BYTES // 8 * slots)).from_address(self.address)
        self._encode(addresses)
        # Each map's address word in self.words, where the driver's layout shows it.
        word = address_word()
        self.address_slots = None if word is None else [i * (_MAP_BYTES // 8) + word for i in range(len(specs))]

    def point(self, addresses):
        if self.address_slots is None:
            self._encode(addresses)
            return
        words = self.words
        for slot, address in zip(self.address_slots, addresses):
            words[slot] = address

    def _encode(self, addresses):
        for i, (spec, address) in enumerate(zip(self.specs, addresses)):
            ctypes.memmove(self.address + i * _MAP_BYTES, encode_tiled(address, *spec), _MAP_BYTES)
