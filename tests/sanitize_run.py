"""Forward and backward at a few odd shapes, for compute-sanitizer (memcheck, racecheck); not a pytest file.

    compute-sanitizer --tool memcheck python tests/sanitize_run.py
CuPy's memory pool is switched off so every buffer is its own cudaMalloc and an out-of-bounds
access cannot hide inside a neighbouring pool block. Exits non-zero if any result is wrong.
--kvcache-only runs flash_attn_with_kvcache's calls alone. With --plant it first launches a kernel
that writes one element past its buffer, to show that the sanitizer in use does catch such a bug
(it must then report an error).
"""

import sys

import cupy

from cupyflash import _check
from cupyflash._check import Case

CASES = [Case(113, 113, 72, "float16", True, batch=1),
         Case(17, 300, 40, "bfloat16", False, batch=1, nheads=4, nheads_k=1),
         Case(300, 17, 256, "bfloat16", True, batch=1),
         Case(65, 129, 128, "float16", True, batch=1, nheads=2, nheads_k=1),
         # the two-stage forward and the 80-row backward (hd128), partial last blocks
         Case(200, 233, 120, "bfloat16", False, batch=1, nheads=2),
         # the options: window (LOCAL kernels), every option of the OPTIONS kernels with dbias, deterministic, varlen
         Case(113, 150, 64, "bfloat16", False, batch=1, nheads=2, window_size=(20, 7)),
         Case(70, 90, 96, "float16", True, batch=2, nheads=2, nheads_k=1, softcap=2.0, alibi_slopes=True, attn_bias="full",
              dropout_p=0.2),
         Case(70, 90, 64, "bfloat16", True, batch=1, nheads=2, attn_bias="keys", deterministic=True),
         # a 16-bit bias ('heads') read as words: on H200, before Q K^T (wgmma, hd128), after it (mma.sync, hd96)
         Case(70, 90, 128, "bfloat16", True, batch=1, nheads=2, attn_bias="heads"),
         Case(70, 90, 96, "float16", False, batch=1, nheads=2, attn_bias="heads"),
         Case.packed((0, 37, 5), (9, 0, 70), 128, "float16", True, nheads=2, nheads_k=1, window_size=(11, -1),
                     dropout_p=0.1, deterministic=True),
         # the wgmma backward's options (H200): softcap, ALiBi and a full bias with dbias, GQA
         Case(70, 90, 64, "float16", False, batch=2, nheads=2, nheads_k=1, softcap=2.0, alibi_slopes=True,
              attn_bias="full"),
         # dropout alone: its decisions drawn beside the products (wgmma fwd and bwd, hd128 and hd256)
         Case(130, 150, 128, "bfloat16", True, batch=1, nheads=2, dropout_p=0.15),
         Case(70, 90, 256, "float16", False, batch=1, nheads=2, dropout_p=0.15),
         # a varlen plain backward with an empty sequence (wgmma on H200: TMA over the packed rows)
         Case.packed((0, 37, 5), (9, 0, 70), 64, "bfloat16", True, nheads=2, nheads_k=1),
         # the wgmma hd64 backward's 128-row query blocks past a head's or a sequence's padded rows
         Case(17, 200, 64, "float16", False, batch=2, nheads=2),
         Case.packed((66, 1, 130), (70, 9, 128), 64, "bfloat16", False, nheads=4, nheads_k=2),
         # more query tiles than an H200 has SMs: the wgmma forward's persistent CTAs take several
         # (hd64 up to 1k rows on two consumers, LOCAL tiles back to back)
         Case(300, 200, 64, "bfloat16", True, batch=2, nheads=70, nheads_k=10),
         # LOCAL hd128 tiles back to back, rows that see no key among them
         Case(600, 150, 128, "bfloat16", True, batch=2, nheads=70, nheads_k=10)]
# LOCAL tiles taken from the tile counter (next_tile in cuda_src/sm90/fwd.cuh) in groups of 3 (batch entry,
# head) pairs, as calls whose K and V exceed the L2 take them, with varlen rows that see no key; the
# backward's kv heads one group each
COUNTER_CASES = [Case(300, 200, 64, "float16", True, batch=2, nheads=60, nheads_k=10),
                 Case(1100, 1100, 64, "bfloat16", True, batch=1, nheads=6, nheads_k=3),  # 192-row tiles
                 Case(300, 200, 256, "bfloat16", True, batch=2, nheads=12, nheads_k=4),
                 Case.packed((0, 370, 45, 600), (9, 300, 0, 500), 128, "bfloat16", True, nheads=16, nheads_k=4,
                             window_size=(90, 0))]


def in_groups(group):
    """Plans from here on walk LOCAL forward tiles in groups of `group` pairs (_schedule.tile_group) and
    run the LOCAL backward's kv heads in groups of one (_schedule.head_group)."""
    from cupyflash import _plan, _schedule
    _plan._plans.clear()
    _schedule.tile_group = lambda pairs, kv_bytes_per_pair, l2_bytes, ctas, counter_share: min(group, pairs)
    _schedule.head_group = lambda heads, bytes_per_head, l2_bytes: 1


def kvcache_cases():
    """flash_attn_with_kvcache calls for the sanitizer (append and rotary, split decode, combine): paged
    and dense, cache_batch_idx and cache_leftpad, a padded head dim; each against the NumPy path."""
    import numpy
    import cupyflash
    from cupyflash._arrays import bfloat16_dtype
    rng = numpy.random.default_rng(0)
    draw = lambda *shape: rng.standard_normal(shape).astype(bfloat16_dtype())  # noqa: E731
    paged = dict(q=draw(2, 3, 8, 72), k_cache=draw(9, 16, 2, 72), v_cache=draw(9, 16, 2, 72), k=draw(2, 3, 2, 72),
                 v=draw(2, 3, 2, 72), rotary_cos=draw(70, 16), rotary_sin=draw(70, 16),
                 cache_seqlens=numpy.array([0, 40], numpy.int32), block_table=numpy.array([[4, 0, 7, 2], [1, 8, 3, 5]],
                                                                                         numpy.int32))
    dense = dict(q=draw(3, 1, 4, 128), k_cache=draw(5, 300, 4, 128), v_cache=draw(5, 300, 4, 128),
                 cache_seqlens=numpy.array([299, 5, 130], numpy.int32), cache_batch_idx=numpy.array([4, 0, 2], numpy.int32),
                 cache_leftpad=numpy.array([3, 0, 130], numpy.int32))
    # pages of 256 rows at hd128, new rows across a page boundary
    big_pages = dict(q=draw(2, 2, 8, 128), k_cache=draw(4, 256, 2, 128), v_cache=draw(4, 256, 2, 128),
                     k=draw(2, 2, 2, 128), v=draw(2, 2, 2, 128), rotary_cos=draw(600, 32), rotary_sin=draw(600, 32),
                     cache_seqlens=numpy.array([255, 100], numpy.int32),
                     block_table=numpy.array([[2, 0], [1, 3]], numpy.int32))
    for arrays, options in ((paged, dict(causal=True, num_splits=3)), (dense, dict(softcap=5.0, num_splits=2)),
                            (dense, dict(causal=True)), (big_pages, dict(causal=True, rotary_interleaved=False))):
        want = cupyflash.flash_attn_with_kvcache(**{n: a.copy() for n, a in arrays.items()}, **options)
        got = cupyflash.flash_attn_with_kvcache(**{n: cupy.asarray(a) for n, a in arrays.items()}, **options)
        error = float(numpy.abs(cupy.asnumpy(got).astype(numpy.float64) - want.astype(numpy.float64)).max())
        yield f"kvcache {sorted(arrays)} {options}", error <= 0.05 * float(numpy.abs(want.astype(numpy.float64)).max())


def plant_out_of_bounds_write():
    buffer = cupy.zeros(1000, dtype=cupy.float32)
    write_past_end = cupy.RawKernel('extern "C" __global__ void k(float* x, int n) { x[n + threadIdx.x] = 1.f; }', "k")
    write_past_end((1,), (32,), (buffer, cupy.int32(buffer.size)))
    cupy.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    cupy.cuda.set_allocator(None)
    if "--plant" in sys.argv:
        plant_out_of_bounds_write()
    failed = 0
    cases = [] if "--kvcache-only" in sys.argv else CASES + [None] + COUNTER_CASES
    for i, case in enumerate(cases):
        if case is None:
            in_groups(3)
            continue
        result = _check.run_gpu_case(case, seed=i)
        print(f"{'ok  ' if result.ok else 'FAIL'} {case}: {result.describe()}", flush=True)
        failed += not result.ok
    for name, ok in kvcache_cases():
        print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
        failed += not ok
    sys.exit(1 if failed else 0)
