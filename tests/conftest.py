"""GPU tests are marked `gpu` and skip cleanly where CuPy sees no CUDA device."""

import pytest

from cupyflash._arrays import gpu_available

HAS_GPU = gpu_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no CUDA GPU visible to CuPy")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    config.addinivalue_line("markers", "smoke: the quick GPU tier covering every kernel family (tests/test_smoke.py)")


@pytest.fixture
def poisoned_allocations():
    """Every CuPy allocation during the test starts filled with 0xFF bytes: NaN in fp16, bf16 and
    fp32, so any output element a kernel fails to write shows up as NaN."""
    import cupy
    pool = cupy.get_default_memory_pool()

    def poisoning_malloc(size):
        memory = pool.malloc(size)
        if size:
            cupy.cuda.runtime.memsetAsync(memory.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return memory

    cupy.cuda.set_allocator(poisoning_malloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(pool.malloc)
