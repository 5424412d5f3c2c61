// Which keys a query sees, and which whole blocks can be skipped. Every masking rule lives here
// (a kernel family's per-element masks test is_visible or its bounds), so every kernel agrees.
//
// Masks are aligned bottom-right (as flash_attn >= 2.1): row i's diagonal is key
// i + seqlen_k - seqlen_q. The LOCAL kernels bound each row's keys to
// [diagonal - window_left, diagonal + window_right]: causal is window_right = 0, and an unbounded
// side is 1 << 30, so there is no "unbounded" test per element. A row may see no key at all.
#pragma once
#include "math.cuh"
#include "ptx.cuh"
#include "params.cuh"

// The sequence a CTA works on: batch entry `batch`, or with cu_seqlens one packed sequence.
struct Sequence {
    int seqlen_q, seqlen_k;
    int first_row_q, first_row_k;  // where it starts in the packed tensors (0 unless varlen)

    __device__ __forceinline__ Sequence(const FlashParams& p, int batch) {
        if (p.cu_seqlens_q == nullptr) {
            seqlen_q = p.seqlen_q; seqlen_k = p.seqlen_k; first_row_q = 0; first_row_k = 0;
        } else {
            first_row_q = min(max(p.cu_seqlens_q[batch], 0), p.total_q);
            first_row_k = min(max(p.cu_seqlens_k[batch], 0), p.total_k);
            seqlen_q = min(min(max(p.cu_seqlens_q[batch + 1], first_row_q), p.total_q) - first_row_q, p.seqlen_q);
            seqlen_k = min(min(max(p.cu_seqlens_k[batch + 1], first_row_k), p.total_k) - first_row_k, p.seqlen_k);
        }
    }
    // A sequence of these lengths whose kernel addresses its rows itself (the KV cache's decode).
    __device__ __forceinline__ Sequence(int rows_q, int rows_k)
        : seqlen_q(rows_q), seqlen_k(rows_k), first_row_q(0), first_row_k(0) {}
    __device__ __forceinline__ int diagonal(int row) const { return row + seqlen_k - seqlen_q; }
    // Index of (batch, head, row 0) in the row statistics (lse).
    __device__ __forceinline__ long long stats_row0(const FlashParams& p, int batch, int head) const {
        return batch * p.stats_batch_stride + head * p.stats_head_stride + first_row_q;
    }
    // Index of (batch, head, row 0) in the backward's padded rows (dq_accum, lse_log2, D): a
    // multiple of kPaddedRows, so that a query block's rows are one aligned piece (a bulk copy's).
    // A varlen sequence starts at kPaddedRows ceil(first_row / kPaddedRows) + gap batch: a gap of
    // 64 rows a sequence, 128 in the 80-row backward's layout (`transposed_dq`, where
    // p.dq_accum_fragment_rows != 0: a last block of 80 rows in fragment order reaches further), so
    // that it starts after the previous sequence's whole blocks.
    static constexpr int kPaddedRows = 64;
    __device__ __forceinline__ long long padded_row0(const FlashParams& p, int batch, int head,
                                                     bool transposed_dq = false) const {
        const int gap = transposed_dq ? 2 * kPaddedRows : kPaddedRows;
        return batch * p.padded_batch_stride + head * p.padded_head_stride
               + (p.cu_seqlens_q == nullptr ? 0 : kPaddedRows * ceil_div(first_row_q, kPaddedRows) + gap * batch);
    }
};

// dq_accum holds dQ in fp32 blocks of 8 rows x 8 columns, 64 consecutive floats each (row-major
// inside, and the blocks row-major): the 8 x 8 piece of an accumulator fragment that one warp-wide
// reduction adds is 256 contiguous bytes (in row-major rows it would touch 8 cache lines), and a
// row's 8-column chunk is 8 contiguous floats for the row kernels. `row` counts from a multiple of 8
// (a padded row, Sequence::padded_row0).
__device__ __forceinline__ long long dq_accum_index(long long row, int col, int width) {
    return (row & ~7LL) * width + (col & ~7) * 8 + (row & 7) * 8 + (col & 7);
}

// The 80-row wgmma backward (sm90/bwd.cuh, kDQTransposed: dQ^T = K^T dS^T, each consumer 64 of
// dQ's 128 columns) leaves a query block's `rows` x 128 floats of dq_accum (the same span of the
// buffer) in its accumulators' register order instead, so that a thread's four floats of an
// 8-query tile are one 16-byte store: consumer, 8-query tile, thread, element. (Column m of a
// consumer's 64 is the fragment row 16 warp + lane / 4 + 8 (element / 2); query row r its column
// 8 tile + 2 (lane % 4) + element % 2.) p.dq_accum_fragment_rows says the convert reads it so.
__device__ __forceinline__ int dq_accum_fragment_index(int row, int col, int rows) {
    const int m = col % 64, thread = 32 * (m / 16) + 4 * (m % 8) + (row % 8) / 2;
    return (((col / 64) * (rows / 8) + row / 8) * 128 + thread) * 4 + (m % 16) / 8 * 2 + row % 2;
}

// The deterministic backward's counter of (batch, head, query block): how many of the key blocks
// that the query block sees have added their dQ (they add in key-block order).
__device__ __forceinline__ int* dq_turn_counter(const FlashParams& p, int batch, int head, int q_block) {
    return p.dq_semaphore + (static_cast<long long>(batch) * p.nheads + head) * p.dq_semaphore_blocks + q_block;
}

// A CTA's (block, head, batch). CTAs start in about launch order, x fastest, and under a causal
// mask a block's weight follows its index (each kernel maps the slot's block 0 to its heaviest).
// With p.block_major the grid is (heads, blocks, batch): a batch entry's heads all start their
// heavy blocks first and the grid ends on light CTAs, where (blocks, heads, batch) ends on the
// last head's heaviest CTA while the other SMs idle. Only blockIdx and a parameter, no arithmetic:
// ptxas re-reads these where registers are short (computed indices spill in the LOCAL hd128 backward).
// PAIR_GROUPS (the wgmma backward, which reads its slot once): x runs over a group of gridDim.x
// (batch entry, kv head) pairs, batch-major, and z over the groups (_schedule.pair_group): the
// CTAs in flight read only the group's rows, which then stay in the L2, and a group of several
// batch entries (a short grid's) starts all their heaviest blocks before any light one.
struct GridSlot {
    int block, blocks, head, batch;
};

template <bool LOCAL, bool PAIR_GROUPS = false>
__device__ __forceinline__ GridSlot grid_slot(const FlashParams& p) {
    const bool block_major = LOCAL && p.block_major;
    if (PAIR_GROUPS && block_major) {
        const int pair = blockIdx.z * gridDim.x + blockIdx.x;
        return GridSlot{int(blockIdx.y), int(gridDim.y), pair % p.nheads_k, pair / p.nheads_k};
    }
    return GridSlot{int(block_major ? blockIdx.y : blockIdx.x), int(block_major ? gridDim.y : gridDim.x),
                    int(block_major ? blockIdx.x : blockIdx.y), int(blockIdx.z)};
}

template <bool LOCAL>
__device__ __forceinline__ bool is_visible(const FlashParams& p, const Sequence& seq, int row, int col) {
    return col < seq.seqlen_k
           && (!LOCAL || (col <= seq.diagonal(row) + p.window_right && col >= seq.diagonal(row) - p.window_left));
}

// A fragment row's elements as bits: bit 2 t + j stands for the column at offset 8 t + j (j < 2)
// from the lane's first (common/fragment.cuh). Offsets grow with the bit, so the columns a row sees
// are a run of bits, which ptxas moves to predicates seven at a time (R2P): a few instructions a
// row, where is_visible per element costs several.
// How many of those offsets are at most x (none for x < 0; the count may pass the row's elements).
__device__ __forceinline__ int fragment_cols_upto(int x) { return (x >> 3) + ((x + 7) >> 3) + 1; }

// The bits of the offsets in [lo, hi] (up to 16 column tiles).
__device__ __forceinline__ uint32 fragment_run(int lo, int hi) {
    const int first = max(fragment_cols_upto(lo - 1), 0);
    return bit_run(first, max(fragment_cols_upto(hi) - first, 0));
}

// The keys from col0 on that query `row` sees, as offsets from col0: [lo, hi], empty where hi < lo.
// Either end may lie past a tile's columns; lo may be negative (a fragment has no offsets below 0).
struct KeyOffsets {
    int lo, hi;
};
template <bool LOCAL>
__device__ __forceinline__ KeyOffsets key_offsets_seen(const FlashParams& p, const Sequence& seq, int row, int col0) {
    KeyOffsets seen{0, seq.seqlen_k - 1 - col0};
    if (LOCAL) {
        seen.lo = seq.diagonal(row) - p.window_left - col0;
        seen.hi = min(seen.hi, seq.diagonal(row) + p.window_right - col0);
    }
    return seen;
}

// is_visible by rows of a fragment: the keys from col0 that query `row` sees (S), and the queries
// from col0 that see key `key` (the wgmma backward's S^T).
template <bool LOCAL>
__device__ __forceinline__ uint32 keys_seen(const FlashParams& p, const Sequence& seq, int row, int col0) {
    const KeyOffsets seen = key_offsets_seen<LOCAL>(p, seq, row, col0);
    return fragment_run(seen.lo, seen.hi);
}
template <bool LOCAL>
__device__ __forceinline__ uint32 queries_seeing(const FlashParams& p, const Sequence& seq, int key, int col0) {
    const int shift = seq.seqlen_k - seq.seqlen_q;  // a query row's diagonal is row + shift
    const int lo = LOCAL ? key - shift - p.window_right - col0 : 0;
    const int hi = key >= seq.seqlen_k ? -1 : LOCAL ? key - shift + p.window_left - col0 : 1 << 30;
    return fragment_run(lo, hi);
}

// Sets the elements of one fragment row (half `half` of column tiles nt0 .. nt0 + COUNT - 1)
// whose bit in `seen` is clear to `hidden`: 0 for probabilities, -inf for scores before their exps.
template <int COUNT, int NT>
__device__ __forceinline__ void hide_unseen(float (&s)[NT][4], int nt0, int half, uint32 seen, float hidden) {
    static_assert(COUNT <= 16, "a row's fragment elements are the bits of one word");
#pragma unroll
    for (int c = 0; c < COUNT; ++c)
#pragma unroll
        for (int j = 0; j < 2; ++j)
            if (!((seen >> (2 * c + j)) & 1u)) s[nt0 + c][2 * half + j] = hidden;
}

// Key blocks [first, end) that query rows [row0, row0 + block_m) see at all: the blocks outside
// are fully masked and are skipped, not computed.
struct BlockRange {
    int first, end;
};

template <bool LOCAL>
__device__ __forceinline__ BlockRange key_blocks_seen(const FlashParams& p, const Sequence& seq, int row0,
                                                      int block_m, int block_n) {
    int key_begin = 0, key_end = seq.seqlen_k;
    if (LOCAL) {
        key_begin = max(key_begin, seq.diagonal(row0) - p.window_left);
        key_end = min(key_end, seq.diagonal(min(row0 + block_m, seq.seqlen_q) - 1) + p.window_right + 1);
    }
    return key_begin < key_end ? BlockRange{key_begin / block_n, ceil_div(key_end, block_n)} : BlockRange{0, 0};
}

// Query blocks [first, end) that see any key of the block starting at key0 (the backward's loop).
template <bool LOCAL>
__device__ __forceinline__ BlockRange query_blocks_seeing(const FlashParams& p, const Sequence& seq, int key0,
                                                          int block_m, int block_n) {
    int row_begin = 0, row_end = seq.seqlen_q;
    if (LOCAL) {
        const int shift = seq.seqlen_k - seq.seqlen_q;
        const int key_last = min(key0 + block_n, seq.seqlen_k) - 1;
        row_begin = max(row_begin, key0 - shift - p.window_right);
        row_end = min(row_end, key_last - shift + p.window_left + 1);
    }
    return row_begin < row_end ? BlockRange{row_begin / block_m, ceil_div(row_end, block_m)} : BlockRange{0, 0};
}

// The backward's steps for one key block: the query blocks that see it (`blocks`), of each query
// head of its kv group in turn, walked up from the first or, in the deterministic LOCAL backwards,
// down from the last: they add a query block's dQ in key-block order, and walking up, the later key
// blocks (seeing fewer query blocks, from a later one) would reach each query block first and wait
// there for the earlier ones; walking down, all reach it together.
template <int BLOCK_M, bool DETERMINISTIC, bool LOCAL>
struct QueryWalk {
    static constexpr bool DOWN = DETERMINISTIC && LOCAL;
    const BlockRange& blocks;
    __device__ __forceinline__ int first_row0() const { return (DOWN ? blocks.end - 1 : blocks.first) * BLOCK_M; }
    // The next step's (head, row0), with no division.
    __device__ __forceinline__ void advance(int& head, int& row0) const {
        row0 += DOWN ? -BLOCK_M : BLOCK_M;
        if (DOWN ? row0 < blocks.first * BLOCK_M : row0 >= blocks.end * BLOCK_M) {
            row0 = first_row0();
            ++head;
        }
    }
};

// Key blocks that query rows [row0, row0 + block_m) see whole, with no mask: a sub-range of
// `seen` (possibly empty, first == end). The blocks of `seen` before it are masked by a window's
// left edge, those after it by the diagonal or the sequence's partial last block.
template <bool LOCAL>
__device__ __forceinline__ BlockRange key_blocks_unmasked(const FlashParams& p, const Sequence& seq, int row0,
                                                          int block_m, int block_n, BlockRange seen) {
    int key_begin = 0, key_end = seq.seqlen_k;  // keys every row sees
    if (LOCAL) {
        key_begin = max(key_begin, seq.diagonal(row0 + block_m - 1) - p.window_left);
        key_end = min(key_end, seq.diagonal(row0) + p.window_right + 1);
    }
    const int first = max(seen.first, ceil_div(max(key_begin, 0), block_n));
    const int end = min(seen.end, key_end / block_n);
    return BlockRange{first, max(first, end)};
}

// Whether a (query block, key block) pair needs per-element masking; all other pairs run the
// mask-free path.
template <bool LOCAL>
__device__ __forceinline__ bool block_needs_mask(const FlashParams& p, const Sequence& seq, int row0, int key0,
                                                 int block_m, int block_n) {
    const int key_last = key0 + block_n - 1;
    return key_last >= seq.seqlen_k
           || (LOCAL && (key_last > seq.diagonal(row0) + p.window_right
                         || key0 < seq.diagonal(row0 + block_m - 1) - p.window_left));
}
