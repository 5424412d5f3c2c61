// Hopper's warpgroup matrix multiply (wgmma, sm_90a). A warpgroup is 4 consecutive warps, the
// first a multiple of 4; together they multiply a 64-row A by an N-column B into fp32
// accumulators that stay in registers: warp w of the group holds rows 16w..16w+15, laid out as
// mma.sync's m16n8 C fragment repeated over the N / 8 column blocks (d[4j..4j+3] is block j).
// Operands in shared memory are named by 64-bit descriptors (below). The calls are asynchronous:
// wgmma_fence() before the first (after the accumulators or A's registers were written),
// wgmma_commit() after the last of a group, wgmma_wait<N>() before reading the results.
#pragma once

#include "../common/ptx.cuh"

typedef unsigned long long uint64;

// A tile in the 128-byte swizzle that the descriptors below name: rows of 64 16-bit elements
// (128 bytes) one after another, whose 16-byte chunk c sits at chunk c ^ (row % 8); 8 rows make a
// 1024-byte atom. A tile wider than 64 elements is stored as 64-wide column blocks one after
// another. The tile starts at a multiple of 1024 bytes.
constexpr int kSwizzleRowBytes = 128;
constexpr int kSwizzleAtomBytes = 1024;

// The byte offset of element (row, col) of a swizzled tile of `rows` rows.
__device__ __forceinline__ uint32 swizzled_offset(int row, int col, int rows) {
    const int block = col / 64, chunk = (col % 64) / 8, within = col % 8;
    return block * rows * kSwizzleRowBytes + row * kSwizzleRowBytes + ((chunk ^ (row % 8)) * 16) + within * 2;
}

// Descriptor fields: start address >> 4 (bits 0-13), leading byte offset >> 4 (16-29), stride
// byte offset >> 4 (32-45), swizzle mode (62-63: 1 is the 128-byte swizzle, 0 none).
__device__ __forceinline__ uint64 smem_descriptor(uint32 address, uint32 leading_bytes, uint32 stride_bytes,
                                                  uint64 swizzle = 1) {
    return static_cast<uint64>((address & 0x3FFFF) >> 4) | static_cast<uint64>(leading_bytes >> 4) << 16
           | static_cast<uint64>(stride_bytes >> 4) << 32 | swizzle << 62;
}

// The byte offset of the k-th 16-wide slice of a K-major tile of `rows` rows (below) from its start.
__host__ __device__ constexpr uint32 k_major_offset(int k, int rows) {
    return (k / 4) * rows * kSwizzleRowBytes + (k % 4) * 32;
}

// An operand stored K-major (K contiguous: Q and K in S = Q K^T): the k-th 16-wide slice of a
// swizzled tile of `rows` rows. Within a column block the slice starts 32 bytes further per step
// (the hardware applies the swizzle to the address it forms); 8-row atoms are 1024 bytes apart.
__device__ __forceinline__ uint64 k_major_descriptor(uint32 tile, int k, int rows) {
    return smem_descriptor(tile + k_major_offset(k, rows), 16, kSwizzleAtomBytes);
}

// desc moved BYTES further into its tile. IN_ORDER: by an instruction the compiler keeps beside
// the product that reads it, where otherwise it would compute every descriptor of a loop ahead
// and hold each in two registers; a 32-bit add to the start address field, which cannot carry
// out of it (shared memory ends below 2^18 bytes), so the upper word is not recomputed.
template <uint32 BYTES, bool IN_ORDER>
__device__ __forceinline__ uint64 descriptor_plus(uint64 desc) {
    if constexpr (!IN_ORDER) return desc + (BYTES >> 4);
    uint64 moved;
    asm volatile("{\n.reg .b32 lo, hi;\nmov.b64 {lo, hi}, %1;\nadd.s32 lo, lo, %2;\nmov.b64 %0, {lo, hi};\n}\n"
                 : "=l"(moved) : "l"(desc), "n"(BYTES >> 4));
    return moved;
}

// An operand stored N-major (N contiguous: V, whose rows are keys, in O = P V): the k-th 16-row
// slice (16 keys) of a swizzled tile of `rows` rows. 16 rows are two 1024-byte atoms; the leading
// byte offset steps from one 64-wide column block to the next.
__device__ __forceinline__ uint64 n_major_descriptor(uint32 tile, int k, int rows) {
    return smem_descriptor(tile + k * 16 * kSwizzleRowBytes, rows * kSwizzleRowBytes, kSwizzleAtomBytes);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// Shared memory written by ordinary stores and read next by wgmma or the copy engine.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Each wrapper's asm is written once, by a macro, for the two 16-bit input types.
// d (64 x 64 fp32, this warpgroup's) (+)= A (64 x 16, shared, descriptor) * B (64 x 16, shared, descriptor)^T;
// each operand K-major, or MN-major where TRANS_A / TRANS_B (as n_major_descriptor names it).
#define CUPYFLASH_WGMMA_SS(TYPES)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPES " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                 : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(int(TRANS_A)), "n"(int(TRANS_B)))
template <bool BF16, bool TRANS_A, bool TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64 desc_a, uint64 desc_b, bool accumulate) {
    if (BF16) CUPYFLASH_WGMMA_SS("bf16.bf16");
    else CUPYFLASH_WGMMA_SS("f16.f16");
}
#undef CUPYFLASH_WGMMA_SS

// d (64 x 80 fp32) (+)= A (64 x 16, shared, descriptor) * B (80 x 16, shared, descriptor)^T.
#define CUPYFLASH_WGMMA_SS(TYPES)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n80k16.f32." TYPES " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, %43, %44;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]) \
                 : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(int(TRANS_A)), "n"(int(TRANS_B)))
template <bool BF16, bool TRANS_A, bool TRANS_B>
__device__ __forceinline__ void wgmma_m64n80k16_ss(float (&d)[40], uint64 desc_a, uint64 desc_b, bool accumulate) {
    if (BF16) CUPYFLASH_WGMMA_SS("bf16.bf16");
    else CUPYFLASH_WGMMA_SS("f16.f16");
}
#undef CUPYFLASH_WGMMA_SS

// d (64 x 128 fp32, this warpgroup's) (+)= A (64 x 16, shared, descriptor) * B (128 x 16, shared, descriptor)^T.
#define CUPYFLASH_WGMMA_SS(TYPES)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPES " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                 : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(int(TRANS_A)), "n"(int(TRANS_B)))
template <bool BF16, bool TRANS_A, bool TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64 desc_a, uint64 desc_b, bool accumulate) {
    if (BF16) CUPYFLASH_WGMMA_SS("bf16.bf16");
    else CUPYFLASH_WGMMA_SS("f16.f16");
}
#undef CUPYFLASH_WGMMA_SS

// d (64 x 64 fp32) (+)= A (64 x 16, registers: mma.sync's m16n8k16 A fragment per warp) *
// B (16 x 64, shared, descriptor; TRANS_B: stored 64-major, as V is).
#define CUPYFLASH_WGMMA_RS(TYPES)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPES " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(int(TRANS_B)))
template <bool BF16, bool TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32 (&a)[4], uint64 desc_b, bool accumulate) {
    if (BF16) CUPYFLASH_WGMMA_RS("bf16.bf16");
    else CUPYFLASH_WGMMA_RS("f16.f16");
}
#undef CUPYFLASH_WGMMA_RS

// d (64 x 128 fp32) (+)= A (64 x 16, registers: mma.sync's m16n8k16 A fragment per warp) *
// B (16 x 128, shared, descriptor; TRANS_B: stored 128-major, as V is).
#define CUPYFLASH_WGMMA_RS(TYPES)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPES " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(int(TRANS_B)))
template <bool BF16, bool TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32 (&a)[4], uint64 desc_b, bool accumulate) {
    if (BF16) CUPYFLASH_WGMMA_RS("bf16.bf16");
    else CUPYFLASH_WGMMA_RS("f16.f16");
}
#undef CUPYFLASH_WGMMA_RS

// By the column count N (64, 80 or 128) of the 64 x N accumulator.
template <int N, bool BF16, bool TRANS_A = false, bool TRANS_B = false>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64 desc_a, uint64 desc_b, bool accumulate) {
    static_assert(N == 64 || N == 80 || N == 128, "wgmma_ss is written for N = 64, 80 and 128");
    if constexpr (N == 64) wgmma_m64n64k16_ss<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
    else if constexpr (N == 80) wgmma_m64n80k16_ss<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
    else wgmma_m64n128k16_ss<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
}
// B N-major (as V is stored).
template <int N, bool BF16>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32 (&a)[4], uint64 desc_b, bool accumulate) {
    static_assert(N == 64 || N == 128, "wgmma_rs is written for N = 64 and 128");
    if constexpr (N == 64) wgmma_m64n64k16_rs<BF16, true>(d, a, desc_b, accumulate);
    else wgmma_m64n128k16_rs<BF16, true>(d, a, desc_b, accumulate);
}

// This thread's warpgroup. BROADCAST: read from lane 0, which ptxas takes as the same in every
// lane, so that what derives from it (shared-memory addresses, operand descriptors) lives in
// uniform registers rather than being recomputed per thread and moved there for each product.
template <bool BROADCAST>
__device__ __forceinline__ int warpgroup_index() {
    return BROADCAST ? __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) : threadIdx.x / 128;
}

// Named barriers of two consumer warpgroups (256 threads; barrier 0 is __syncthreads).
__device__ __forceinline__ void consumers_sync(int id) { asm volatile("bar.sync %0, 256;\n" :: "r"(id) : "memory"); }
__device__ __forceinline__ void consumers_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" :: "r"(id) : "memory"); }
// A named barrier of one warpgroup (128 threads).
__device__ __forceinline__ void warpgroup_sync(int id) { asm volatile("bar.sync %0, 128;\n" :: "r"(id) : "memory"); }

// Moves registers between warpgroups (the kernel must be launched with a register cap, i.e.
// __launch_bounds__(threads, 1)): a producer gives its spare ones up, consumers take them.
template <int REGISTERS>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGISTERS)); }
template <int REGISTERS>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGISTERS)); }

// An accumulator fragment array (say float[1][MT][4]) as the flat registers the wrappers take.
template <typename Fragments>
__device__ __forceinline__ auto& flat(Fragments& acc) {
    return reinterpret_cast<float(&)[sizeof(Fragments) / sizeof(float)]>(acc);
}

// Pins accumulator registers in the instruction order: the compiler does not see that a wgmma
// writes them only by its wgmma_wait, and would otherwise move their reads (or a rescale's
// writes) across the wait, which makes ptxas serialise the products.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32 (&a)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i]) :: "memory");
}

// Accumulator rows leave through shared memory as whole 16-byte rows, a warp writing whole rows:
// stores straight from the fragments write 4 bytes a thread into 8 rows an instruction. A stage
// holds a warpgroup's 64 rows of TILES 16-byte chunks (TILES 8-column tiles of 16-bit values), a
// row's chunks swizzled by the row, so that both the stmatrix stores and the row reads are free of
// bank conflicts; each warp reads back only the 16 rows (from 16 (warp % 4)) that it stored.
template <int TILES>
__device__ __forceinline__ uint32 staged_offset(int row, int chunk) {
    static_assert(TILES % 2 == 0 && TILES >= 8, "pairs of column tiles; at least 8 chunks a row for the swizzle");
    return uint32(row * 16 * TILES + ((chunk ^ (row % 8)) * 16));
}

// This warp's 16 rows of `acc` times `scale`, as 16-bit values, into `stage` (aligned to a row,
// 16 TILES bytes, so that the swizzle of a chunk is an exclusive or of the address).
template <bool BF16, int TILES>
__device__ __forceinline__ void stage_rows(uint32 stage, const float (&acc)[1][TILES][4], float scale) {
    // stmatrix's matrix m = lane / 8 is column tile dt + m / 2, rows 8 (m % 2) to 8 (m % 2) + 7 of the
    // warp's 16; dt is even, so chunk dt + m / 2 swizzled is dt ^ (m / 2 ^ row % 8): tile 0's address
    // with 16 dt exclusive-or'ed in.
    const int lane = threadIdx.x % 32, row = 16 * (threadIdx.x / 32 % 4) + 8 * (lane / 8 % 2) + lane % 8;
    const uint32 first = stage + staged_offset<TILES>(row, lane / 16);
#pragma unroll
    for (int dt = 0; dt < TILES; dt += 2)
        stmatrix_x4(first ^ uint32(16 * dt),
                    pack_pair<BF16>(acc[0][dt][0] * scale, acc[0][dt][1] * scale),
                    pack_pair<BF16>(acc[0][dt][2] * scale, acc[0][dt][3] * scale),
                    pack_pair<BF16>(acc[0][dt + 1][0] * scale, acc[0][dt + 1][1] * scale),
                    pack_pair<BF16>(acc[0][dt + 1][2] * scale, acc[0][dt + 1][3] * scale));
}

// visit(half, col, chunk) for each 16-byte chunk that this lane holds of `acc` times `scale` as 16-bit
// values (columns col to col + 7 of its fragment row fragment_row(0, 2 half)), with no shared memory: a
// quad holds a row's 32 columns of four column tiles as one word each (tile d's word of lane q:
// columns 8d + 2q and 8d + 2q + 1); transposed over the quad (2 x 2 blocks of words traded across
// lanes q ^ 2, then each block across lanes q ^ 1), lane q holds columns 8q to 8q + 7 of the 32. A
// warp's stores of them write whole 32-byte sectors, where the fragments' words write each sector
// in two halves.
template <bool BF16, int TILES, typename Visit>
__device__ __forceinline__ void for_each_quad_chunk(const float (&acc)[1][TILES][4], float scale, Visit&& visit) {
    static_assert(TILES % 4 == 0, "groups of four column tiles");
    const int quad_lane = threadIdx.x % 4;
    const bool high_pair = quad_lane & 2, odd_lane = quad_lane & 1;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int group = 0; group < TILES / 4; ++group) {
            uint32 w[4];
#pragma unroll
            for (int d = 0; d < 4; ++d)
                w[d] = pack_pair<BF16>(acc[0][4 * group + d][2 * half] * scale, acc[0][4 * group + d][2 * half + 1] * scale);
#pragma unroll
            for (int d = 0; d < 2; ++d) {  // lanes 0, 1 trade words 2, 3 for lanes 2, 3's words 0, 1
                const uint32 got = __shfl_xor_sync(0xffffffffu, high_pair ? w[d] : w[d + 2], 2);
                w[d] = high_pair ? got : w[d];
                w[d + 2] = high_pair ? w[d + 2] : got;
            }
#pragma unroll
            for (int d = 0; d < 4; d += 2) {  // even lanes trade words 1, 3 for odd lanes' words 0, 2
                const uint32 got = __shfl_xor_sync(0xffffffffu, odd_lane ? w[d] : w[d + 1], 1);
                w[d] = odd_lane ? got : w[d];
                w[d + 1] = odd_lane ? w[d + 1] : got;
            }
            visit(half, 32 * group + 8 * quad_lane, make_uint4(w[0], w[1], w[2], w[3]));
        }
    }
}

// Adds a word's two 16-bit values, the low one first, times `scale` to two accumulator elements.
template <bool BF16>
__device__ __forceinline__ void add_word(float& first, float& second, uint32 word, float scale) {
    first = fmaf(to_float<BF16>(static_cast<uint16>(word)), scale, first);
    second = fmaf(to_float<BF16>(static_cast<uint16>(word >> 16)), scale, second);
}

// Adds a swizzled tile's 16-bit values (of `rows` rows, as TMA writes them) times `scale` to a
// warpgroup accumulator of TILES column tiles: this warp's 16 rows from `row0`, or where `one_row`
// the tile's row 0 to every row. ldmatrix hands each lane its fragment's elements (matrix m =
// lane / 8 as in stage_rows), conflict-free in the swizzle.
template <bool BF16, int TILES>
__device__ __forceinline__ void add_swizzled_tile(float (&acc)[1][TILES][4], uint32 tile, int rows, int row0, float scale,
                                                  bool one_row) {
    const int lane = threadIdx.x % 32, row = one_row ? 0 : row0 + 8 * (lane / 8 % 2) + lane % 8;
#pragma unroll
    for (int nt = 0; nt < TILES; nt += 2) {
        uint32 r[4];  // r[2 j + h]: tile nt + j, rows 8 h to 8 h + 7
        ldmatrix_x4(r, tile + swizzled_offset(row, 8 * (nt + lane / 16), rows));
#pragma unroll
        for (int m = 0; m < 4; ++m)
            add_word<BF16>(acc[0][nt + m / 2][2 * (m % 2)], acc[0][nt + m / 2][2 * (m % 2) + 1], r[m], scale);
    }
}

// The same into an accumulator whose rows are the tile's columns (S^T, keys as rows, from a bias
// tile of queries as rows): query tiles nt0 to nt0 + COUNT - 1 (one, or pairs) of this warp's 16
// keys from `key0` in the tile, or where `one_row` the tile's row 0 for every query. ldmatrix.trans:
// matrix m = lane / 8 of a pair is query tile nt0 + m / 2 (its 8 queries the stored rows), keys
// 8 (m % 2) on; the tile is at most 64 keys wide.
template <bool BF16, int COUNT, int TILES>
__device__ __forceinline__ void add_swizzled_tile_transposed(float (&acc)[TILES][4], int nt0, uint32 tile, int key0,
                                                             float scale, bool one_row) {
    static_assert(COUNT % 2 == 0 || COUNT == 1, "pairs of query tiles, or one");
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int c = 0; c < COUNT; c += 2) {
        constexpr int kTiles = COUNT == 1 ? 1 : 2;  // query tiles an ldmatrix takes
        const int nt = nt0 + c, query = one_row ? 0 : 8 * (nt + lane / 16 % kTiles) + lane % 8;
        const uint32 at = tile + swizzled_offset(query, key0 + 8 * (lane / 8 % 2), 8 * TILES);
        uint32 r[4];
        if (kTiles == 1) ldmatrix_x2_trans(reinterpret_cast<uint32(&)[2]>(r), at);
        else ldmatrix_x4_trans(r, at);
#pragma unroll
        for (int m = 0; m < 2 * kTiles; ++m)
            add_word<BF16>(acc[nt + m / 2][2 * (m % 2)], acc[nt + m / 2][2 * (m % 2) + 1], r[m], scale);
    }
}

// After a __syncwarp that follows stage_rows: visit(row, chunk, offset) for each 16-byte chunk this
// lane reads back (the warp's 16 rows, 32 chunks a step). Pass i reads rows row + kRowsAPass i, whose
// swizzle is row % 8 (below kRowsAPass, a power of two) exclusive-or'ed with kRowsAPass i % 8: with
// HOLD_BASES, each offset is one of a few bases (the first's with a constant exclusive-or'ed in)
// plus a constant, a few instructions fewer a pass for a register or two held (the 160-register
// forwards spill with them); without, each is computed whole.
template <int TILES, bool HOLD_BASES = false, typename Visit>
__device__ __forceinline__ void for_each_staged_chunk(Visit&& visit) {
    static_assert((TILES & (TILES - 1)) == 0, "a power of two chunks a row");
    constexpr int kRowsAPass = 32 / TILES;
    const int lane = threadIdx.x % 32, row = 16 * (threadIdx.x / 32 % 4) + lane / TILES, chunk = lane % TILES;
    const uint32 first = staged_offset<TILES>(row, chunk);
#pragma unroll
    for (int i = 0; i < TILES / 2; ++i)
        visit(row + kRowsAPass * i, chunk,
              HOLD_BASES ? (first ^ uint32(16 * (kRowsAPass * i % 8))) + uint32(kRowsAPass * i * 16 * TILES)
                         : staged_offset<TILES>(row + kRowsAPass * i, chunk));
}
