// The tensor memory accelerator (sm_90): bulk tensor copies from global to shared memory that
// complete on an mbarrier. A copy is named by a tensor map (CUtensorMap, 128 bytes) that the host
// encodes (cupyflash/_tma.py) and the kernel receives by value as a __grid_constant__ parameter.
#pragma once

#include "../common/ptx.cuh"
#include "wgmma.cuh"

// CUtensorMap's size and alignment, without the CUDA headers.
struct alignas(64) TensorMap {
    unsigned long long words[16];
};

__device__ __forceinline__ void mbarrier_init(uint32 bar, int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(arrivals) : "memory");
}
// Makes initialised mbarriers visible to the copy engine.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also tells the barrier how many bytes its copies will deliver.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32 bar, uint32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
// One plain arrival (a consumer done with a buffer).
__device__ __forceinline__ void mbarrier_arrive(uint32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Waits until the barrier's phase `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32 bar, int parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n"
        :: "r"(bar), "r"(parity) : "memory");
}

// The box of `map` at coordinates (x, y) (x the innermost dimension, in elements) into shared
// memory at `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32 dst, const TensorMap* map, uint32 bar, int x, int y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
        :: "r"(dst), "l"(map), "r"(bar), "r"(x), "r"(y) : "memory");
}

// The same for a 4-D tensor map (x, y, z, w, innermost first).
__device__ __forceinline__ void tma_load_4d(uint32 dst, const TensorMap* map, uint32 bar, int x, int y, int z, int w) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        :: "r"(dst), "l"(map), "r"(bar), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}

// COLS columns from col0 of `map`'s ROWS rows from (row, head, batch) into dst, as 64-wide column
// blocks one after another (the swizzled layout of wgmma.cuh), completing on `bar` (whose bytes the
// caller expects).
template <int ROWS, int COLS>
__device__ __forceinline__ void copy_column_blocks(uint32 dst, const TensorMap* map, uint32 bar, int col0, int row,
                                                   int head, int batch) {
#pragma unroll
    for (int cb = 0; cb < COLS / 64; ++cb)
        tma_load_4d(dst + cb * ROWS * kSwizzleRowBytes, map, bar, col0 + 64 * cb, row, head, batch);
}

// A ROWS x HEADDIM tile of `map` from (row, head, batch) into dst (copy_column_blocks), completing
// on `bar`, which also waits for `other_bytes` of copies the caller issues after it.
template <int ROWS, int HEADDIM>
__device__ __forceinline__ void load_tile(uint32 dst, const TensorMap* map, uint32 bar, int row, int head, int batch,
                                          uint32 other_bytes = 0) {
    mbarrier_arrive_expect_tx(bar, ROWS * HEADDIM * 2 + other_bytes);
    copy_column_blocks<ROWS, HEADDIM>(dst, map, bar, 0, row, head, batch);
}

// `bytes` (a multiple of 16) from global `src` (16-byte aligned) into shared memory at `dst`,
// completing on `bar`: a bulk copy, no tensor map.
__device__ __forceinline__ void bulk_load(uint32 dst, const void* src, uint32 bytes, uint32 bar) {
    mbarrier_arrive_expect_tx(bar, bytes);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// dst[i] += src[i] for `bytes` (a multiple of 16) of fp32 from shared memory at `src` into global
// `dst` (both 16-byte aligned): a bulk reduction, in the bulk group of this thread.
__device__ __forceinline__ void bulk_reduce_add(float* dst, uint32 src, uint32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
// Orders this thread's global accesses through the generic proxy with its bulk (async proxy) ones.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk groups have read their sources (READ), or are complete.
template <bool READ>
__device__ __forceinline__ void bulk_wait_all() {
    if (READ) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    else asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
