// Probes of the Hopper building blocks, each checked against NumPy by tests/test_hopper_probes.py:
// wgmma with both operands in shared memory (S = Q K^T's form), wgmma with A in registers and an
// N-major B (O = P V's form), and a TMA load in the 128-byte swizzle. They pin down the
// descriptor and layout facts the sm90 kernels rely on, one small kernel each.
#pragma once

#include "wgmma.cuh"
#include "tma.cuh"

// Shared memory from the next 1024-byte boundary (the swizzle atom); launches ask for 1 KiB more.
__device__ __forceinline__ unsigned char* swizzle_aligned(unsigned char* smem) {
    const uint32 address = smem_address(smem);
    return smem + ((1024 - address % 1024) % 1024);
}

// rows x cols 16-bit elements (row-major, cols a multiple of 8) into a swizzled tile, by 16-byte copies.
__device__ __forceinline__ void store_swizzled(unsigned char* tile, const uint16* src, int rows, int cols) {
    for (int i = threadIdx.x; i < rows * cols / 8; i += blockDim.x) {
        const int row = i / (cols / 8), col = i % (cols / 8) * 8;
        *reinterpret_cast<uint4*>(tile + swizzled_offset(row, col, rows)) =
            *reinterpret_cast<const uint4*>(src + row * cols + col);
    }
}

// A warpgroup's 64 x N fp32 accumulators to row-major global memory.
template <int N>
__device__ __forceinline__ void store_accumulators(float* d, const float (&acc)[N / 2]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = 16 * warp + lane / 4, col = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        d[row * N + 8 * j + col] = acc[4 * j];
        d[row * N + 8 * j + col + 1] = acc[4 * j + 1];
        d[(row + 8) * N + 8 * j + col] = acc[4 * j + 2];
        d[(row + 8) * N + 8 * j + col + 1] = acc[4 * j + 3];
    }
}

// d (64 x N) = a (64 x K) b (N x K)^T, both K-major in shared memory; one warpgroup.
template <bool BF16, int N, int K>
__device__ void wgmma_probe_ss(const uint16* a, const uint16* b, float* d) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* tile_a = swizzle_aligned(smem_raw);
    unsigned char* tile_b = tile_a + 64 * K * 2;
    store_swizzled(tile_a, a, 64, K);
    store_swizzled(tile_b, b, N, K);
    fence_proxy_async();
    __syncthreads();
    float acc[N / 2];
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < K / 16; ++k) {
        const uint64 desc_a = k_major_descriptor(smem_address(tile_a), k, 64);
        const uint64 desc_b = k_major_descriptor(smem_address(tile_b), k, N);
        wgmma_ss<N, BF16>(acc, desc_a, desc_b, k > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    store_accumulators<N>(d, acc);
}

// d (64 x N) = p (64 x K, from registers) v (K x N, N-major in shared memory); one warpgroup.
// `leading` and `stride` are the descriptor's byte offsets, so that the test can tell which
// layout the hardware reads.
template <bool BF16, int N, int K>
__device__ void wgmma_probe_rs(const uint16* p, const uint16* v, float* d, uint32 leading, uint32 stride) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* tile_v = swizzle_aligned(smem_raw);
    store_swizzled(tile_v, v, K, N);
    fence_proxy_async();
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = 16 * warp + lane / 4, col = 2 * (lane % 4);
    const uint32* p32 = reinterpret_cast<const uint32*>(p);  // pairs of 16-bit elements
    float acc[N / 2];
    uint32 frag[K / 16][4];
#pragma unroll
    for (int k = 0; k < K / 16; ++k) {
        frag[k][0] = p32[(row * K + 16 * k + col) / 2];
        frag[k][1] = p32[((row + 8) * K + 16 * k + col) / 2];
        frag[k][2] = p32[(row * K + 16 * k + col + 8) / 2];
        frag[k][3] = p32[((row + 8) * K + 16 * k + col + 8) / 2];
    }
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < K / 16; ++k) {
        const uint64 desc_v = smem_descriptor(smem_address(tile_v) + k * 16 * kSwizzleRowBytes, leading, stride);
        if constexpr (N == 64) wgmma_m64n64k16_rs<BF16, true>(acc, frag[k], desc_v, k > 0);
        else wgmma_m64n128k16_rs<BF16, true>(acc, frag[k], desc_v, k > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    store_accumulators<N>(d, acc);
}

// The box at (x, y) of `map` loaded by TMA, its shared-memory bytes copied out as they lie.
__device__ void tma_probe(const TensorMap* map, unsigned char* out, int x, int y, int bytes) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* tile = swizzle_aligned(smem_raw);
    __shared__ alignas(8) unsigned long long bar;
    const uint32 bar_address = smem_address(&bar);
    if (threadIdx.x == 0) {
        mbarrier_init(bar_address, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(bar_address, bytes);
        tma_load_2d(smem_address(tile), map, bar_address, x, y);
    }
    mbarrier_wait(bar_address, 0);
    for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x)
        reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(tile)[i];
}

#define CUPYFLASH_WGMMA_PROBES(SUFFIX, BF16)                                                              \
    extern "C" __global__ void __launch_bounds__(128) wgmma_probe_ss_n64_k64_##SUFFIX(                      \
        const uint16* a, const uint16* b, float* d) { wgmma_probe_ss<BF16, 64, 64>(a, b, d); }              \
    extern "C" __global__ void __launch_bounds__(128) wgmma_probe_ss_n128_k128_##SUFFIX(                    \
        const uint16* a, const uint16* b, float* d) { wgmma_probe_ss<BF16, 128, 128>(a, b, d); }            \
    extern "C" __global__ void __launch_bounds__(128) wgmma_probe_rs_n64_k64_##SUFFIX(                      \
        const uint16* p, const uint16* v, float* d, uint32 leading, uint32 stride) {                      \
        wgmma_probe_rs<BF16, 64, 64>(p, v, d, leading, stride); }                                            \
    extern "C" __global__ void __launch_bounds__(128) wgmma_probe_rs_n128_k64_##SUFFIX(                     \
        const uint16* p, const uint16* v, float* d, uint32 leading, uint32 stride) {                      \
        wgmma_probe_rs<BF16, 128, 64>(p, v, d, leading, stride); }

CUPYFLASH_WGMMA_PROBES(bf16, true)
CUPYFLASH_WGMMA_PROBES(fp16, false)

extern "C" __global__ void __launch_bounds__(128) tma_probe_2d(const __grid_constant__ TensorMap map,
                                                               unsigned char* out, int x, int y, int bytes) {
    tma_probe(&map, out, x, y, bytes);
}
