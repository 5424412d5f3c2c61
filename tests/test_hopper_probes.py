"""The Hopper building blocks (cuda_src/sm90/probes.cuh) against NumPy: wgmma with both operands
in shared memory (S = Q K^T's form), wgmma with A in registers and an N-major B (O = P V's form),
and a TMA load in the 128-byte swizzle (cupyflash/_tma.py's tensor map). The compile check runs
anywhere (NVRTC, sm_90a); the rest on a GPU of compute capability 9.0."""

import ctypes

import numpy
import pytest

from cupyflash import _compile, _sources

_OPTIONS = ("-std=c++17", "-default-device", "--ptxas-options=-v", "--gpu-architecture=sm_90a")
_ENTRIES = [f"wgmma_probe_{form}_{dtype}" for form in ("ss_n64_k64", "ss_n128_k128", "rs_n64_k64", "rs_n128_k64")
            for dtype in ("bf16", "fp16")] + ["tma_probe_2d"]


@pytest.fixture(scope="module")
def probes():
    """(cubin, ptxas log) of the probes for sm_90a."""
    pytest.importorskip("cupy")
    return _compile._nvrtc(_sources.translation_unit("sm90/probes.cuh"), "probes", _OPTIONS)


def test_probes_compile_for_sm90a_without_spills(probes):
    _, log = probes
    entries = log.count("Compiling entry function")
    assert entries == len(_ENTRIES), log
    assert log.count("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads") == entries, log


def _hopper():
    cupy = pytest.importorskip("cupy")
    from cupyflash._arrays import gpu_available
    if not gpu_available() or cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a GPU of compute capability 9.0")
    return cupy


def _launch(module, name, smem_bytes, *args):
    """Launches probe `name` on one warpgroup; args are ctypes values (device pointers as c_uint64)."""
    import cupy
    function = module.get_function(name)
    function.max_dynamic_shared_size_bytes = smem_bytes
    argv = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    cupy.cuda.driver.launchKernel(function.kernel.ptr, 1, 1, 1, 128, 1, 1, smem_bytes, 0, ctypes.addressof(argv), 0)
    cupy.cuda.Device().synchronize()


@pytest.fixture(scope="module")
def module(probes):
    cupy = _hopper()
    return cupy.RawModule(code=_sources.translation_unit("sm90/probes.cuh"), options=_OPTIONS[:2] + ("-arch=sm_90a",))


def _operands(rng, shape, dtype):
    """A random 16-bit array and its float64 values."""
    x = rng.standard_normal(shape).astype(numpy.float32)
    if dtype == "bf16":
        import ml_dtypes
        x = x.astype(ml_dtypes.bfloat16)
        return x, x.astype(numpy.float64)
    x = x.astype(numpy.float16)
    return x, x.astype(numpy.float64)


def _close(got, want):
    # fp32 accumulation of exact 16-bit products: only the order of the adds differs
    numpy.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * numpy.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("n, k", [(64, 64), (128, 128)])
def test_wgmma_with_both_operands_in_shared_memory(module, dtype, n, k):
    import cupy
    rng = numpy.random.default_rng(n + k)
    (a, a64), (b, b64) = _operands(rng, (64, k), dtype), _operands(rng, (n, k), dtype)
    da, db = cupy.asarray(a.view(numpy.uint16)), cupy.asarray(b.view(numpy.uint16))
    d = cupy.full((64, n), numpy.nan, numpy.float32)
    _launch(module, f"wgmma_probe_ss_n{n}_k{k}_{dtype}", (64 + n) * k * 2 + 1024,
            *(ctypes.c_uint64(x.data.ptr) for x in (da, db, d)))
    _close(cupy.asnumpy(d), a64 @ b64.T)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("n", [64, 128])
def test_wgmma_with_a_from_registers_and_an_n_major_b(module, dtype, n):
    """O = P V's form, with the byte offsets n_major_descriptor sets: the leading one steps between
    64-wide column blocks of V, the stride one between 8-row atoms. (The probe takes both as
    arguments, so that other readings of the two fields can be tried without recompiling.)"""
    import cupy
    k = 64
    rng = numpy.random.default_rng(n)
    (p, p64), (v, v64) = _operands(rng, (64, k), dtype), _operands(rng, (k, n), dtype)
    dp, dv = cupy.asarray(p.view(numpy.uint16)), cupy.asarray(v.view(numpy.uint16))
    d = cupy.full((64, n), numpy.nan, numpy.float32)
    leading, stride = k * 128, 1024  # as n_major_descriptor sets them
    _launch(module, f"wgmma_probe_rs_n{n}_k{k}_{dtype}", k * n * 2 + 1024,
            *(ctypes.c_uint64(x.data.ptr) for x in (dp, dv, d)), ctypes.c_uint32(leading), ctypes.c_uint32(stride))
    _close(cupy.asnumpy(d), p64 @ v64)


def _swizzled(tile):
    """The bytes of a (rows, 64) 16-bit tile in the 128-byte swizzle (wgmma.cuh's swizzled_offset)."""
    rows = tile.shape[0]
    chunks = tile.view(numpy.uint8).reshape(rows, 8, 16)
    out = numpy.empty_like(chunks)
    for row in range(rows):
        out[row, numpy.arange(8) ^ (row % 8)] = chunks[row]
    return out.reshape(-1)


@pytest.mark.gpu
def test_tma_loads_a_box_in_the_128_byte_swizzle(module):
    import cupy
    from cupyflash import _tma
    rng = numpy.random.default_rng(7)
    rows, cols, box_rows, x, y = 200, 192, 64, 64, 32  # a 64 x 64 box at column 64, row 32
    matrix = rng.integers(0, 2 ** 16, (rows, cols), dtype=numpy.uint16)
    device = cupy.asarray(matrix)
    tensor_map = _tma.encode_tiled(device.data.ptr, "float16", (cols, rows), (cols * 2,), (64, box_rows))
    out = cupy.zeros(box_rows * 128, numpy.uint8)
    map_arg = ctypes.create_string_buffer(tensor_map, 128)
    _launch(module, "tma_probe_2d", box_rows * 128 + 1024, map_arg, ctypes.c_uint64(out.data.ptr),
            ctypes.c_int(x), ctypes.c_int(y), ctypes.c_int(box_rows * 128))
    numpy.testing.assert_array_equal(cupy.asnumpy(out), _swizzled(matrix[y:y + box_rows, x:x + 64]))


@pytest.mark.gpu
def test_the_driver_keeps_a_tensor_maps_address_in_one_word():
    """Plans aim their tensor maps at each call's arrays by rewriting one word (cupyflash/_tma.py);
    were the address not kept verbatim, every call would encode its maps again (correct, slower)."""
    _hopper()
    from cupyflash import _tma
    assert _tma.address_word() is not None
