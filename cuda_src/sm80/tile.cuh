// Shared-memory tiles and the warp-level matrix products built on them.
//
// A tile is ROWS x COLS 16-bit elements, row-major, in one of two layouts (TileLayout, by COLS):
// - Swizzled (COLS 64, 128 or 256): rows are not padded, so each row is whole 128-byte lines, and
//   in row r the 16-byte chunk c of each line sits at c ^ (r % 8). The 8 lanes of a cp.async that
//   read one 128-byte line of global memory write one line of shared memory (a warp's copy is 4
//   shared-memory wavefronts; padded rows straddle lines: 7), and the 8 rows that one
//   ldmatrix phase reads sit in 8 different 16-byte bank groups: no conflicts. A step of 16
//   columns is an XOR of the lane's address (TileLayout::moved), a step of 8 rows an add.
//   (At 64 columns, swizzled against padded: +2% in the non-causal hd64 passes, -1% in the
//   causal hd64 backward, whose loop has 24 more SASS instructions.)
// - Padded (other widths): each row padded by 16 elements (32 bytes), and in rows with bit 2 set
//   each 16-byte chunk trades places with its neighbour (chunk c sits at c ^ 1). Rows start on
//   32-byte boundaries (every 32-byte sector a cp.async reads lands in one aligned sector); a padded
//   row is 2 mod 4 chunks long, so rows r and r + 4 start in the same bank group and the swap moves
//   one of them to the other parity. The swap flips only bit 0 of a chunk index, so steps of 16
//   columns or 8 rows are plain offsets.
//
// Register fragments: common/fragment.cuh.
#pragma once
#include "../common/fragment.cuh"
#include "../common/ptx.cuh"

template <int COLS>
struct TileLayout {
    static_assert(COLS % 32 == 0, "tile columns must be a multiple of 32");
    static constexpr bool kSwizzled = COLS == 64 || COLS == 128 || COLS == 256;
    static constexpr int kStride = kSwizzled ? COLS : COLS + 16;  // elements per smem row
    template <int ROWS>
    __host__ __device__ static constexpr int bytes() { return ROWS * kStride * 2; }
    // Where element (row, col) sits, in elements from the tile's start (which is 128-byte aligned).
    __host__ __device__ static constexpr int offset(int row, int col) {
        return row * kStride + (kSwizzled ? col ^ ((row & 7) << 3) : col ^ ((row & 4) << 1));
    }
    // The shared address `drow` rows and `dcol` columns on from a lane's address, both compile-time
    // multiples of 8 and 16. Swizzled, the step within a 128-byte line is an XOR, exact when it does
    // not carry into the lane's own column bits: a lane's column is its warp's offset, a multiple of
    // the (power of two) span the warp's steps cover, plus 8 at most. The rest of the step moves
    // whole lines, so the XOR may come first (XORed bases, then immediate offsets: fewer
    // instructions) or last (no XORed base kept live: fewer registers).
    template <bool XOR_LAST = false>
    __device__ static uint32 moved(uint32 address, int drow, int dcol) {
        const uint32 lines = 2 * (drow * kStride + dcol - dcol % 64), flip = 2 * (dcol % 64);
        if constexpr (!kSwizzled) return address + 2 * (drow * kStride + dcol);
        else if constexpr (XOR_LAST) return (address + lines) ^ flip;
        else return (address ^ flip) + lines;
    }
    // The layout's two promises, checked at compile time for every tile width in use: rows start on
    // 32-byte boundaries, and rows 0-7 at any one chunk sit in 8 different 16-byte bank groups.
    __host__ __device__ static constexpr bool sector_aligned_and_conflict_free() {
        for (int chunk = 0; chunk < COLS / 8; ++chunk) {
            int groups_seen = 0;
            for (int row = 0; row < 8; ++row) {
                const int group = offset(row, 8 * chunk) / 8 % 8;
                if (row * kStride % 16 != 0 || (groups_seen >> group & 1)) return false;
                groups_seen |= 1 << group;
            }
        }
        return true;
    }
    static_assert(sector_aligned_and_conflict_free(), "tile rows must be 32-byte aligned and ldmatrix conflict-free");
};

// A ROWS x COLS product split over WARPS warps. Each warp takes 32 rows (two m16 tiles) where the
// columns then split evenly, else 16: with two m16 tiles every B fragment read from shared memory
// feeds two mma instead of one, and shared-memory bandwidth, not the tensor cores, is what
// limits these products.
__host__ __device__ constexpr bool even_split(int rows, int cols, int warps, int warp_rows) {
    return rows % warp_rows == 0 && warps % (rows / warp_rows) == 0 && rows / warp_rows <= warps
           && cols % (8 * (warps / (rows / warp_rows))) == 0;
}

template <int ROWS, int COLS, int WARPS>
struct WarpGrid {
    static constexpr int kWarpRows = even_split(ROWS, COLS, WARPS, 32) ? 32 : 16;
    static constexpr int kWarpsM = ROWS / kWarpRows;
    static constexpr int kWarpsN = WARPS / kWarpsM;
    static constexpr int MT = kWarpRows / 16;
    static constexpr int NT = COLS / kWarpsN / 8;
    static_assert(even_split(ROWS, COLS, WARPS, kWarpRows), "warps must tile the product evenly");
    // Column offsets are multiples of a warp's span, 8 NT; with NT a power of two the XOR steps of
    // TileLayout::moved inside a swizzled tile never carry into them.
    static_assert(!TileLayout<COLS>::kSwizzled || (NT & (NT - 1)) == 0, "a warp's columns in a swizzled tile span a power of two");
    __device__ static int row0() { return (threadIdx.x / 32) % kWarpsM * kWarpRows; }
    __device__ static int col0() { return (threadIdx.x / 32) / kWarpsM * (8 * NT); }
};

// Thread layout of a tile copy: each thread moves one 16-byte column chunk of a row at each of
// kSteps steps, and a step covers kRowsPerStep rows. (With head dims like 96, THREADS %
// chunks-per-row threads idle.) Where a thread's rows all have the same chunk order, its shared
// address moves by compile-time offsets from one base: with kRowsPerStep a multiple of 8, and with
// 4 (hd224, hd256 on 128 threads), where rows r and r + 4 have their chunks in orders that differ
// by an XOR (kOddStepFlip): at odd steps the thread moves the chunk that lands where its chunk
// landed at even steps. Elsewhere the order is worked out per step.
template <int ROWS, int COLS, int THREADS>
struct CopyLayout {
    static constexpr int kChunksPerRow = COLS / 8;
    static constexpr int kRowsPerStep = THREADS / kChunksPerRow;
    static constexpr int kSteps = (ROWS + kRowsPerStep - 1) / kRowsPerStep;
    static constexpr bool kOneBase = kRowsPerStep % 8 == 0 || kRowsPerStep == 4;
    static constexpr int kOddStepFlip = kRowsPerStep != 4 ? 0 : TileLayout<COLS>::kSwizzled ? 4 : 1;
    static_assert(kRowsPerStep > 0, "a tile row must not have more 16-byte chunks than the block has threads");
    __device__ static int slot() { return threadIdx.x / kChunksPerRow; }  // which of a step's rows
    __device__ static int row(int step) { return slot() + step * kRowsPerStep; }
    __device__ static int col(int step) { return 8 * (threadIdx.x % kChunksPerRow ^ (step % 2 ? kOddStepFlip : 0)); }
    __device__ static bool active(int step) {
        return slot() < kRowsPerStep && (ROWS % kRowsPerStep == 0 || row(step) < ROWS);
    }
    // This thread's element offset in the tile at a step.
    __device__ static int smem_offset(int step) {
        typedef TileLayout<COLS> P;
        if (kOneBase) return P::offset(slot(), col(0)) + step * kRowsPerStep * P::kStride;
        return P::offset(row(step), col(step));
    }
};

// Copies rows [0, ROWS) x columns [0, COLS) of a global matrix (row stride `row_stride`
// elements, columns contiguous) into a smem tile with cp.async.
// Rows >= row_limit and columns >= col_limit are zero-filled and never read. Without CHECK_ROWS
// the caller guarantees row_limit >= ROWS.
template <int ROWS, int COLS, int THREADS, bool CHECK_COLS, bool CHECK_ROWS = true>
__device__ __forceinline__ void copy_tile_async(uint16* smem, const uint16* gmem, long long row_stride,
                                                int row_limit, int col_limit) {
    typedef CopyLayout<ROWS, COLS, THREADS> L;
    const uint16* first[2] = {gmem + L::slot() * row_stride + L::col(0), gmem + L::slot() * row_stride + L::col(1)};
    const uint16* next = first[0];  // one column: one 64-bit add per step
    const uint32 tile = smem_address(smem);
#pragma unroll
    for (int step = 0; step < L::kSteps; ++step, next += L::kRowsPerStep * row_stride) {
        if (L::active(step)) {
            const bool valid = (!CHECK_COLS || L::col(step) < col_limit) && (!CHECK_ROWS || L::row(step) < row_limit);
            // (Alternating columns count from two first rows: 81 fewer SASS instructions in the
            // hd256 forward's loop than one pointer and a column offset at odd steps.)
            const uint16* src = L::kOddStepFlip ? first[step % 2] + step * L::kRowsPerStep * row_stride : next;
            cp_async_16(tile + 2 * L::smem_offset(step), valid ? src : gmem, valid);
        }
    }
}

// The reverse, with plain 16-byte loads and stores: smem tile -> global, bounded the same way.
template <int ROWS, int COLS, int THREADS, bool CHECK_COLS>
__device__ __forceinline__ void store_tile(uint16* gmem, const uint16* smem, long long row_stride,
                                           int row_limit, int col_limit) {
    typedef CopyLayout<ROWS, COLS, THREADS> L;
#pragma unroll
    for (int step = 0; step < L::kSteps; ++step) {
        const int row = L::row(step), col = L::col(step);
        if (L::active(step) && row < row_limit && (!CHECK_COLS || col < col_limit))
            *reinterpret_cast<uint4*>(gmem + row * row_stride + col) =
                *reinterpret_cast<const uint4*>(smem + L::smem_offset(step));
    }
}

// Writes a warp's fp32 accumulator, times `scale`, as 16-bit values into a smem tile at
// (row0, col0). Each thread stores 4-byte pairs; a warp's 32 stores hit 32 different banks.
template <bool BF16, int MT, int NT, int COLS>
__device__ __forceinline__ void store_fragment(uint16* smem, const float (&acc)[MT][NT][4], float scale,
                                               int row0, int col0) {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + mt * 16 + g + 8 * half;
                const int col = col0 + nt * 8 + 2 * t;
                *reinterpret_cast<uint32*>(smem + TileLayout<COLS>::offset(row, col)) =
                    pack_pair<BF16>(acc[mt][nt][2 * half] * scale, acc[mt][nt][2 * half + 1] * scale);
            }
}

// The same on sm_90 with stmatrix: one instruction stores two n8 tiles (four 8x8 matrices), a
// quarter of store_fragment's instructions, for a few more live registers. (Elsewhere it is
// store_fragment.)
template <bool BF16, int MT, int NT, int COLS>
__device__ __forceinline__ void store_fragment_by_matrix(uint16* smem, const float (&acc)[MT][NT][4], int row0,
                                                         int col0) {
#if __CUDA_ARCH__ >= 900
    typedef TileLayout<COLS> L;
    const int lane = threadIdx.x % 32;
    auto pair = [&](int mt, int nt, int half) { return pack_pair<BF16>(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]); };
    // Lane i addresses row i % 8 of matrix i / 8: the (top, bottom) halves of n8 tile nt, then of nt + 1.
    const uint32 lane_base = smem_address(smem + TileLayout<COLS>::offset(row0 + lane % 8 + 8 * ((lane / 8) % 2), col0 + 8 * (lane / 16)));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt + 1 < NT; nt += 2)
            stmatrix_x4(L::moved(lane_base, 16 * mt, 8 * nt), pair(mt, nt, 0), pair(mt, nt, 1), pair(mt, nt + 1, 0),
                        pair(mt, nt + 1, 1));
        if (NT % 2 == 1) stmatrix_x2(L::moved(lane_base, 16 * mt, 8 * (NT - 1)), pair(mt, NT - 1, 0), pair(mt, NT - 1, 1));
    }
#else
    store_fragment<BF16, MT, NT, COLS>(smem, acc, 1.f, row0, col0);
#endif
}

// ldmatrix addresses are split in two: the lane's base address (run-time, computed once per
// product) and the step's offset (compile-time after unrolling, folded into the instruction).
//
// A operand (16 x 16 per m16 tile). A_ROW_MAJOR: the tile stores A[m][k] (k contiguous);
// otherwise it stores A transposed, as [k][m], and ldmatrix.trans undoes it.
template <int A_COLS, bool A_ROW_MAJOR>
__device__ __forceinline__ uint32 a_base(const uint16* tile, int m0) {
    const int lane = threadIdx.x % 32;
    typedef TileLayout<A_COLS> P;
    if (A_ROW_MAJOR) return smem_address(tile + P::offset(m0 + lane % 8 + 8 * ((lane / 8) % 2), 8 * (lane / 16)));
    return smem_address(tile + P::offset(lane % 8 + 8 * (lane / 16), m0 + 8 * ((lane / 8) % 2)));
}

// B operand, two adjacent n8 tiles (16 x 16) at a time. B_COL_MAJOR: the tile stores B[n][k]
// (k contiguous, as K is stored for Q K^T); otherwise it stores B[k][n].
template <int B_COLS, bool B_COL_MAJOR>
__device__ __forceinline__ uint32 b_base(const uint16* tile, int n0) {
    const int lane = threadIdx.x % 32;
    typedef TileLayout<B_COLS> P;
    if (B_COL_MAJOR) return smem_address(tile + P::offset(n0 + lane % 8 + 8 * (lane / 16), 8 * ((lane / 8) % 2)));
    return smem_address(tile + P::offset(lane % 8 + 8 * ((lane / 8) % 2), n0 + 8 * (lane / 16)));
}

// The i-th 16-wide block at depth k0 of an operand, from its lane base: four 8x8 matrices (an A
// fragment, or the B fragments of two n8 tiles) or two (one n8 tile of B: ldmatrix.x2 reads the
// addresses of lanes 0-15, which the x4 bases already point at these two matrices). K_CONTIGUOUS
// tiles are read as stored, the others through ldmatrix.trans.
template <int COLS, bool K_CONTIGUOUS, int N, bool XOR_LAST = false>
__device__ __forceinline__ void load_fragment(uint32 (&r)[N], uint32 lane_base, int i, int k0) {
    typedef TileLayout<COLS> L;
    const uint32 address = K_CONTIGUOUS ? L::template moved<XOR_LAST>(lane_base, 16 * i, k0)
                                        : L::template moved<XOR_LAST>(lane_base, k0, 16 * i);
    if constexpr (N == 4) {
        if (K_CONTIGUOUS) ldmatrix_x4(r, address);
        else ldmatrix_x4_trans(r, address);
    } else {
        if (K_CONTIGUOUS) ldmatrix_x2(r, address);
        else ldmatrix_x2_trans(r, address);
    }
}

// One 16-deep step: acc[MT][NT] += a[MT] (16 x 16 each) * B[k0 : k0 + 16, n0 : n0 + 8 NT]. B is read
// one pair of n8 tiles at a time, so only 4 of its registers are live at once.
template <bool BF16, int MT, int NT, int B_COLS, bool B_COL_MAJOR, bool XOR_LAST = false>
__device__ __forceinline__ void mma_step(float (&acc)[MT][NT][4], const uint32 (&a)[MT][4], uint32 b_lane_base, int k0) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
        uint32 b[4];
        load_fragment<B_COLS, B_COL_MAJOR, 4, XOR_LAST>(b, b_lane_base, np, k0);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            mma_16x8x16<BF16>(acc[mt][2 * np], a[mt], b[0], b[1]);
            mma_16x8x16<BF16>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
    }
    if (NT % 2 == 1) {
        uint32 b[2];
        load_fragment<B_COLS, B_COL_MAJOR, 2, XOR_LAST>(b, b_lane_base, NT / 2, k0);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma_16x8x16<BF16>(acc[mt][NT - 1], a[mt], b[0], b[1]);
    }
}

// acc[MT][NT] += A[m0 : m0 + 16 MT, 0 : K] * B[0 : K, n0 : n0 + 8 NT], both from shared memory.
template <bool BF16, int MT, int NT, int K, int A_COLS, bool A_ROW_MAJOR, int B_COLS, bool B_COL_MAJOR, bool XOR_LAST = false>
__device__ __forceinline__ void warp_gemm(float (&acc)[MT][NT][4], const uint16* tile_a, int m0,
                                          const uint16* tile_b, int n0) {
    const uint32 a_lane_base = a_base<A_COLS, A_ROW_MAJOR>(tile_a, m0);
    const uint32 b_lane_base = b_base<B_COLS, B_COL_MAJOR>(tile_b, n0);
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 16) {
        uint32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_fragment<A_COLS, A_ROW_MAJOR, 4, XOR_LAST>(a[mt], a_lane_base, mt, k0);
        mma_step<BF16, MT, NT, B_COLS, B_COL_MAJOR, XOR_LAST>(acc, a, b_lane_base, k0);
    }
}

// The same with A already in registers, a[k16][mt][4] (e.g. P after the softmax).
template <bool BF16, int MT, int NT, int K, int B_COLS, bool B_COL_MAJOR, bool XOR_LAST = false>
__device__ __forceinline__ void warp_gemm_a_in_registers(float (&acc)[MT][NT][4], const uint32 (&a)[K / 16][MT][4],
                                                         const uint16* tile_b, int n0) {
    const uint32 b_lane_base = b_base<B_COLS, B_COL_MAJOR>(tile_b, n0);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) mma_step<BF16, MT, NT, B_COLS, B_COL_MAJOR, XOR_LAST>(acc, a[kk], b_lane_base, 16 * kk);
}
