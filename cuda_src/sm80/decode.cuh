// Attention over a KV cache (flash_attn_with_kvcache): decode steps, speculative rows, chunked prefill.
//
// Three kernels, launched in this order on one stream:
//   flash_kvcache_append: the new keys (rotated) and values written into the caches at cache_seqlens.
//   flash_decode: one CTA per (16 packed query rows, key split; kv heads; batch entry). The packed
//     rows are the query rows of every head of each KV group (PackedRows), so K and V are read once
//     per group. On long caches whose groups leave room in the 16 rows, the KV_HEADS kernel takes
//     several kv heads (1 << p.decode_heads_log2): their rows of a token, adjacent in the cache, are
//     read as one run (one head's 128-byte rows stream 2-5% slower, bench/notes/v68), a block's keys
//     are the virtual rows token * heads + kv head, and each row's scores are masked to its own
//     head's. The CTA's warps take the split's key blocks in turn, each warp with its own cp.async
//     ring of STAGES buffers and its own online softmax: no CTA barrier inside the loop, and
//     STAGES - 1 blocks in flight per warp while it computes one. Keys are addressed per row through
//     the cache row (cache_batch_idx) or the block table, from cache_leftpad on. At the end the warps
//     merge by their row maxima; with one split the CTA writes out and lse, else its split's
//     normalised O and lse. On sm_90 a query block's splits (up to 8) can be one thread-block
//     cluster that merges them itself (p.merge_in_cluster, merge_splits_in_cluster), with no
//     combine launch.
//   flash_decode_combine: with several splits, out and lse from the splits' partials, weighted by
//     exp(lse_split - lse), a CTA per row.
// On sm_90 each is a dependent launch (common/ptx.cuh): its CTAs are placed once the kernel before it
// in the stream allows it (the append at its start, the decode after its main loop, the combine at its
// end) and wait for that kernel before their first global read or write, so that a step's kernels,
// and the next step's in a decode loop, start as the last ones drain.
// The split count is the host's (from shapes alone); lengths stay on the device, so a decode step
// captures in a CUDA graph and replays as they change.
#pragma once
#include "../common/math.cuh"
#include "../common/online_softmax.cuh"
#include "../common/score.cuh"
#include "tile.cuh"

// Where sequence b's keys are: its cached length before the append, its first attended position,
// and the cache row or block table row. Key j is cache position start + j.
struct CacheSequence {
    int length;    // cache_seqlens[b]
    int start;     // cache_leftpad[b]
    int seqlen_k;  // keys attended: positions start .. length + seqlen_new - 1
    int row;       // dense: the cache row
    const int* pages;  // paged: the block table row, else null

    __device__ __forceinline__ CacheSequence(const FlashParams& p, int batch) {
        length = min(max(p.cache_seqlens != nullptr ? p.cache_seqlens[batch] : p.cache_seqlens_all, 0),
                     p.capacity - p.seqlen_new);
        start = p.cache_leftpad != nullptr ? min(max(p.cache_leftpad[batch], 0), p.capacity) : 0;
        seqlen_k = max(length + p.seqlen_new - start, 0);
        row = p.cache_batch_idx != nullptr ? min(max(p.cache_batch_idx[batch], 0), p.cache_rows - 1) : batch;
        pages = p.block_table != nullptr ? p.block_table + batch * p.block_table_batch_stride : nullptr;
    }
    // (cache row or block, row within it) of cache position pos (0 <= pos < capacity).
    __device__ __forceinline__ int2 at(const FlashParams& p, int pos) const {
        if (pages == nullptr) return make_int2(row, pos);
        const int page = pos / p.page_size;
        return make_int2(block_of(p, page), pos - page * p.page_size);
    }
    __device__ __forceinline__ int block_of(const FlashParams& p, int page) const {
        return min(max(pages[page], 0), p.cache_rows - 1);
    }
    // at() of positions pos0 .. pos0 + high - 1 (low) and pos0 + high .. (high), high 16 or fewer
    // (a power of two), each run in one page: a paged cache has no left padding, so a key block
    // starts at a multiple of high, and a page holds a multiple of 16 rows. Position r of a run is
    // its first plus r rows. The high run's page is read only where it holds keys (the table may
    // end before it).
    struct Runs {
        int2 low, high;
    };
    __device__ __forceinline__ Runs runs_of(const FlashParams& p, int pos0, int high, bool high_seen) const {
        if (pages == nullptr) return {make_int2(row, pos0), make_int2(row, pos0 + high)};
        const int page = pos0 / p.page_size, offset = pos0 - page * p.page_size, low = block_of(p, page);
        if (offset + high < p.page_size) return {make_int2(low, offset), make_int2(low, offset + high)};
        return {make_int2(low, offset), make_int2(high_seen ? block_of(p, page + 1) : low, 0)};  // the next page's start
    }
};

// The packed query rows of a decode tile: its `heads` kv heads' rows one after another, a head's
// the query rows of every head of its KV group (row r of kv head j: query r / group, head
// (head0 + j) * group + r % group). Rows past the tile's name the last kv head's heads.
struct PackedRows {
    int group, per_head, head0, heads;
    __device__ __forceinline__ int kv_head(int packed) const { return heads == 1 ? 0 : min(packed / per_head, heads - 1); }
    __device__ __forceinline__ int query(int packed) const { return (packed - kv_head(packed) * per_head) / group; }
    __device__ __forceinline__ int head(int packed) const {
        const int j = kv_head(packed);
        return (head0 + j) * group + (packed - j * per_head) % group;
    }
};

// The angle's (cos, sin) of position pos for rotary pair j, from fp32 or 16-bit tables.
template <bool BF16>
__device__ __forceinline__ float2 rotary_angle(const FlashParams& p, int pos, int j) {
    pos = min(max(pos, 0), p.rotary_rows - 1);
    const long long c = pos * p.rotary_cos_row_stride + j, s = pos * p.rotary_sin_row_stride + j;
    if (p.rotary_is_float32)
        return make_float2(static_cast<const float*>(p.rotary_cos)[c], static_cast<const float*>(p.rotary_sin)[s]);
    return make_float2(to_float<BF16>(static_cast<const uint16*>(p.rotary_cos)[c]),
                       to_float<BF16>(static_cast<const uint16*>(p.rotary_sin)[s]));
}

// Dim d's rotary partner and the sign of its term: x[d] turns into x[d] cos + sign x[partner] sin.
__device__ __forceinline__ int rotary_partner(const FlashParams& p, int d, float& sign) {
    if (p.rotary_interleaved) {
        sign = d % 2 == 0 ? -1.f : 1.f;
        return d ^ 1;
    }
    const int half = p.rotary_dim / 2;
    sign = d < half ? -1.f : 1.f;
    return d < half ? d + half : d - half;
}

// One CTA per (new token, batch entry): K (rotated in fp32, then rounded) and V into the caches.
template <bool BF16>
__device__ __forceinline__ void flash_kvcache_append(const FlashParams& p) {
    allow_dependent_grid();
    wait_for_prior_grid();  // (k_new and v_new may be the kernel before's results)
    const int t = blockIdx.x, batch = blockIdx.y;
    const CacheSequence seq(p, batch);
    const int2 at = seq.at(p, seq.length + t);
    const uint16* k_new = static_cast<const uint16*>(p.k_new) + batch * p.k_new_batch_stride + t * p.k_new_row_stride;
    const uint16* v_new = static_cast<const uint16*>(p.v_new) + batch * p.v_new_batch_stride + t * p.v_new_row_stride;
    uint16* k = static_cast<uint16*>(const_cast<void*>(p.k)) + at.x * p.k_batch_stride + at.y * p.k_row_stride;
    uint16* v = static_cast<uint16*>(const_cast<void*>(p.v)) + at.x * p.v_batch_stride + at.y * p.v_row_stride;
    for (int i = threadIdx.x; i < p.nheads_k * p.headdim; i += blockDim.x) {
        const int head = i / p.headdim, d = i % p.headdim;
        const uint16* k_head = k_new + head * p.k_new_head_stride;
        uint16 key = k_head[d];
        if (p.rotary_cos != nullptr && d < p.rotary_dim) {
            float sign;
            const int partner = rotary_partner(p, d, sign);
            const int pair = p.rotary_interleaved ? d / 2 : d % (p.rotary_dim / 2);
            const float2 angle = rotary_angle<BF16>(p, seq.length + t, pair);
            key = to_16bit<BF16>(to_float<BF16>(key) * angle.x + sign * to_float<BF16>(k_head[partner]) * angle.y);
        }
        k[head * p.k_head_stride + d] = key;
        v[head * p.v_head_stride + d] = v_new[head * p.v_new_head_stride + d];
    }
}

template <int HEADDIM, int WARP_N, int WARPS, int STAGES>
struct DecodeTile {
    static constexpr int kRows = 16;  // packed query rows per CTA: one m16 tile
    static constexpr int kThreads = WARPS * 32;
    static constexpr int kWarpElements = STAGES * 2 * WARP_N * TileLayout<HEADDIM>::kStride;  // (K, V) x STAGES buffers
    static constexpr int kSmemBytes = TileLayout<HEADDIM>::template bytes<kRows>() + WARPS * 2 * kWarpElements;
    // The most splits a cluster holds: _launch.MAX_CLUSTER, the portable cluster size (a CPU test checks).
    static constexpr int kClusterSplits = 8;
    // The warps' merge reuses their buffers: a 16 x HEADDIM fp32 O each, then per-row statistics,
    // then the weights of a cluster's splits.
    static constexpr int kMergeBytes = WARPS * kRows * HEADDIM * 4 + 2 * WARPS * kRows * 4 + 2 * kRows * 4
                                       + kRows * kClusterSplits * 4;
    static_assert(kMergeBytes <= kSmemBytes - TileLayout<HEADDIM>::template bytes<kRows>(),
                  "the merge fits in the warps' buffers");
    static_assert(WARP_N % 16 == 0 && HEADDIM % 32 == 0, "tiles are built of 16-wide mma steps");
    static_assert(STAGES >= 2, "a warp computes one buffer while the next loads");
};

// The splits of a query block, a cluster's CTAs (rank = split), merged: O and lse of each row
// from every split's (in its CTA's shared memory, s_o and s_lse), weighted by exp(lse_split - lse),
// as flash_decode_combine does from global memory. Each CTA weighs every row's splits once (a thread
// a row, into s_weights), then writes a share of the rows' columns; a thread's remote reads are
// issued together, so that each phase waits for the cluster's shared memory once.
template <bool BF16, int HEADDIM, int ROWS, int THREADS, int MAX_SPLITS>
__device__ __forceinline__ void merge_splits_in_cluster(const FlashParams& p, const float* s_o, const float* s_lse,
                                                        float* s_weights, int split, int row0, int rows,
                                                        const PackedRows& packing, int batch) {
    static_assert(ROWS <= THREADS, "a thread per row weighs the splits");
    cluster_sync();  // every split's O and lse are in its shared memory
    const uint32 o_address = smem_address(s_o), lse_address = smem_address(s_lse);
    if (threadIdx.x < ROWS) {
        const int r = threadIdx.x;
        float weight[MAX_SPLITS];
        float max = -CUPYFLASH_INF;
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; ++s) {
            weight[s] = s < p.num_splits ? ld_cluster_f32(lse_address + 4 * r, s) : -CUPYFLASH_INF;
            max = fmaxf(max, weight[s]);
        }
        float sum = 0.f;
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; ++s) {  // a split that saw no key weighs nothing
            weight[s] = weight[s] == -CUPYFLASH_INF ? 0.f : __expf(weight[s] - max);
            sum += weight[s];
        }
        const float scale = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; ++s) s_weights[r * MAX_SPLITS + s] = weight[s] * scale;
        const int packed = row0 + r;
        if (split == 0 && packed < rows)
            p.lse[(static_cast<long long>(batch) * p.nheads + packing.head(packed)) * p.seqlen_q
                  + packing.query(packed)] = sum > 0.f ? max + logf(sum) : -CUPYFLASH_INF;
    }
    __syncthreads();
    for (int c = split + p.num_splits * threadIdx.x; c < ROWS * HEADDIM / 4; c += p.num_splits * THREADS) {
        const int r = c / (HEADDIM / 4), col = 4 * (c % (HEADDIM / 4)), packed = row0 + r;
        if (packed >= rows || col >= p.headdim) continue;
        float4 x[MAX_SPLITS];
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; ++s)
            if (s < p.num_splits) x[s] = ld_cluster_f32x4(o_address + 4 * (r * HEADDIM + col), s);
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; ++s)
            if (s < p.num_splits) {
                const float w = s_weights[r * MAX_SPLITS + s];
                o.x += w * x[s].x; o.y += w * x[s].y; o.z += w * x[s].z; o.w += w * x[s].w;
            }
        const int query_row = packing.query(packed), head = packing.head(packed);
        uint16* out = static_cast<uint16*>(p.out) + batch * p.out_batch_stride + query_row * p.out_row_stride
                      + head * p.out_head_stride + col;
        *reinterpret_cast<uint2*>(out) = make_uint2(pack_pair<BF16>(o.x, o.y), pack_pair<BF16>(o.z, o.w));
    }
    cluster_sync();  // no CTA leaves while another reads its shared memory
}

// KV_HEADS: the tile takes 1 << p.decode_heads_log2 kv heads (the host picks this kernel where that
// is more than one); else one, and none of the code below for several is compiled in.
template <int HEADDIM, int WARP_N, int WARPS, int STAGES, bool BF16, bool LOCAL, int FEATURES, bool KV_HEADS>
__device__ __forceinline__ void flash_decode(const FlashParams& p) {
    typedef DecodeTile<HEADDIM, WARP_N, WARPS, STAGES> T;
    typedef TileLayout<HEADDIM> L;
    constexpr int NT = WARP_N / 8, DT = HEADDIM / 8, kChunks = HEADDIM / 8;
    extern __shared__ __align__(128) uint16 smem[];
    uint16* s_q = smem;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint16* s_buffers = smem + T::kRows * L::kStride + warp * T::kWarpElements;

    wait_for_prior_grid();  // the append's keys and values, and whatever wrote q and the lengths
    const int split = blockIdx.x % p.num_splits, m_block = blockIdx.x / p.num_splits;
    const int batch = blockIdx.z;
    // Where 32 is a multiple of a row's chunks (swizzled hd 64, 128, 256), a lane copies the same
    // chunk column of rows lane / kChunks + kRowsPerStep * step at every block: its offsets are
    // kept, a step adds constants to them (rows, and an XOR of the swizzle's row phase), and the
    // run a step's row falls in is a constant. Else each step computes its row and column.
    constexpr bool kLaneFixed = 32 % kChunks == 0 && L::kSwizzled;
    constexpr int kRowsPerStep = kLaneFixed ? 32 / kChunks : 1;
    // The tile's kv heads, a power of two (the host takes several only where their rows fit one
    // tile and a copy step's rows, _kvcache.decode_heads), and the shift from a key's virtual row
    // to its token (a parameter, so uniform).
    static_assert(!KV_HEADS || (kLaneFixed && kRowsPerStep > 1), "several kv heads need a copy step of several rows");
    const int head_shift = KV_HEADS ? p.decode_heads_log2 : 0, heads = 1 << head_shift;
    const int group = p.nheads / p.nheads_k;
    const PackedRows packing{group, p.seqlen_q * group, static_cast<int>(blockIdx.y) * heads, heads};
    const int rows = packing.per_head * heads, row0 = m_block * T::kRows;
    const CacheSequence seq(p, batch);
    const Sequence keys(p.seqlen_q, seq.seqlen_k);  // what masks and score options see: keys 0 .. seqlen_k - 1

    // Q: packed row r is query packing.query(row0 + r) of head packing.head(row0 + r).
    const uint16* q = static_cast<const uint16*>(p.q) + batch * p.q_batch_stride;
    for (int c = threadIdx.x; c < T::kRows * kChunks; c += T::kThreads) {
        const int r = c / kChunks, col = 8 * (c % kChunks), packed = row0 + r;
        const bool valid = packed < rows && col < p.headdim;
        const uint16* src = q + packing.query(packed) * p.q_row_stride + packing.head(packed) * p.q_head_stride + col;
        cp_async_16(smem_address(s_q + L::offset(r, col)), valid ? src : q, valid);
    }
    cp_async_commit();

    // The keys these rows see, in blocks of WARP_N virtual rows (token * heads + kv head), and this
    // split's share: whole blocks, a multiple of WARPS so that the warps finish together. (Several
    // kv heads' rows fit one tile: it holds every query.)
    int key_begin = 0, key_end = seq.seqlen_k;
    if (LOCAL) {
        const int q_first = KV_HEADS ? 0 : packing.query(row0);
        const int q_last = KV_HEADS ? p.seqlen_q - 1 : packing.query(min(row0 + T::kRows, rows) - 1);
        key_begin = max(key_begin, keys.diagonal(q_first) - p.window_left);
        key_end = min(key_end, keys.diagonal(q_last) + p.window_right + 1);
    }
    const int first_block = (key_begin << head_shift) / WARP_N;
    const int blocks = key_end > key_begin ? ceil_div(key_end << head_shift, WARP_N) - first_block : 0;
    const int per_split = ceil_div(ceil_div(blocks, p.num_splits), WARPS) * WARPS;
    const int split_first = first_block + min(split * per_split, blocks);
    const int split_end = first_block + min((split + 1) * per_split, blocks);

    const uint16* k_cache = static_cast<const uint16*>(p.k) + packing.head0 * p.k_head_stride;
    const uint16* v_cache = static_cast<const uint16*>(p.v) + packing.head0 * p.v_head_stride;
    static_assert(WARP_N <= 32, "a block is at most two runs of 16 rows (CacheSequence::runs_of)");
    const int lane_row = lane / kChunks, lane_col = 8 * (lane % kChunks);
    const bool lane_col_seen = lane_col < p.headdim;
    // A block's virtual row r is token r >> head_shift of its run, kv head r & (heads - 1). The host
    // takes several heads only where they fit one copy step's rows (kRowsPerStep, lane-fixed head
    // dims), so every step starts a token and advances the lane's row by whole tokens, as one head's does.
    const int seqlen_v = seq.seqlen_k << head_shift;
    const int lane_token = lane_row >> head_shift, lane_head = lane_row & (heads - 1);
    long long lane_k = lane_token * p.k_row_stride + lane_head * p.k_head_stride + lane_col;
    long long lane_v = lane_token * p.v_row_stride + lane_head * p.v_head_stride + lane_col;
    const uint32 lane_smem = smem_address(s_buffers) + 2 * (lane_row * L::kStride);
    const int lane_swizzled_col = lane_col ^ ((lane_row & 7) << 3);
    const int step_tokens = kRowsPerStep >> head_shift;
    long long k_step = step_tokens * p.k_row_stride, v_step = step_tokens * p.v_row_stride;
    // Kept in registers: ptxas would otherwise recompute them, with the head shift, at every block.
    if constexpr (KV_HEADS) asm volatile("" : "+l"(lane_k), "+l"(lane_v), "+l"(k_step), "+l"(v_step));
    auto load = [&](int n_block, int buffer) {
        const int key0 = n_block * WARP_N;  // (a multiple of heads: a block starts a token)
        // A 32-row block's second half: one head's next 16-row run, or several heads' next tokens
        // of the same run (a block of several heads spans at most 16 aligned tokens: one page).
        const CacheSequence::Runs runs = seq.runs_of(p, seq.start + (key0 >> head_shift), 16 >> head_shift,
                                                     WARP_N > 16 && key0 + 16 < seqlen_v);
        const uint16* k_run[2] = {k_cache + runs.low.x * p.k_batch_stride + runs.low.y * p.k_row_stride,
                                  k_cache + runs.high.x * p.k_batch_stride + runs.high.y * p.k_row_stride};
        const uint16* v_run[2] = {v_cache + runs.low.x * p.v_batch_stride + runs.low.y * p.v_row_stride,
                                  v_cache + runs.high.x * p.v_batch_stride + runs.high.y * p.v_row_stride};
        if constexpr (kLaneFixed) {
            // (a row past the keys copies nothing: src-size 0 reads no byte of its address)
            const uint16* k_row = k_run[0] + lane_k;
            const uint16* v_row = v_run[0] + lane_v;
            const uint32 smem_k = lane_smem + 2 * buffer * 2 * WARP_N * L::kStride;
#pragma unroll
            for (int step = 0; step < WARP_N / kRowsPerStep; ++step) {
                const int drow = kRowsPerStep * step;
                if (drow == 16) {
                    k_row = k_run[1] + lane_k;
                    v_row = v_run[1] + lane_v;
                }
                const bool valid = key0 + lane_row + drow < seqlen_v && lane_col_seen;
                const uint32 dst = smem_k + 2 * (drow * L::kStride + (lane_swizzled_col ^ ((drow & 7) << 3)));
                cp_async_16(dst, k_row, valid);
                cp_async_16(dst + 2 * WARP_N * L::kStride, v_row, valid);
                k_row += k_step;
                v_row += v_step;
            }
        } else {  // (one kv head: the host takes several only on lane-fixed head dims)
            uint16* s_k = s_buffers + buffer * 2 * WARP_N * L::kStride;
            uint16* s_v = s_k + WARP_N * L::kStride;
#pragma unroll
            for (int step = 0; step < ceil_div(WARP_N * kChunks, 32); ++step) {
                const int c = lane + 32 * step;
                if ((WARP_N * kChunks) % 32 != 0 && c >= WARP_N * kChunks) break;
                const int r = c / kChunks, col = 8 * (c % kChunks), run = r / 16, in_run = r % 16;
                const bool valid = key0 + r < seq.seqlen_k && col < p.headdim;
                const uint16* k_first = run == 0 ? k_run[0] : k_run[1];  // (a select: run is not a constant)
                const uint16* v_first = run == 0 ? v_run[0] : v_run[1];
                cp_async_16(smem_address(s_k + L::offset(r, col)),
                            valid ? k_first + in_run * p.k_row_stride + col : k_cache, valid);
                cp_async_16(smem_address(s_v + L::offset(r, col)),
                            valid ? v_first + in_run * p.v_row_stride + col : v_cache, valid);
            }
        }
        cp_async_commit();
    };
    // The warp's first STAGES - 1 blocks in flight (an empty group where there is none: the waits
    // below count groups).
    int n_block = split_first + warp;
#pragma unroll
    for (int stage = 0; stage < STAGES - 1; ++stage) {
        if (n_block + stage * WARPS < split_end) load(n_block + stage * WARPS, stage);
        else cp_async_commit();
    }

    cp_async_wait<STAGES - 1>();
    __syncthreads();  // Q has landed
    if (p.rotary_cos != nullptr) {  // q turned by its rows' positions, in place, one pair per thread
        const int pairs = p.rotary_dim / 2;
        for (int c = threadIdx.x; c < T::kRows * pairs; c += T::kThreads) {
            const int r = c / pairs, j = c % pairs, packed = row0 + r;
            if (packed >= rows) continue;
            const int d0 = p.rotary_interleaved ? 2 * j : j, d1 = p.rotary_interleaved ? 2 * j + 1 : j + pairs;
            const float2 angle = rotary_angle<BF16>(p, seq.length + (p.rotary_q_per_row ? packing.query(packed) : 0), j);
            uint16* x0 = s_q + L::offset(r, d0);
            uint16* x1 = s_q + L::offset(r, d1);
            const float a = to_float<BF16>(*x0), b = to_float<BF16>(*x1);
            *x0 = to_16bit<BF16>(a * angle.x - b * angle.y);
            *x1 = to_16bit<BF16>(a * angle.y + b * angle.x);
        }
        __syncthreads();
    }

    // This thread's two fragment rows (g and g + 8): their queries and kv heads, and the score
    // options of their heads.
    const int packed[2] = {row0 + fragment_row(0, 0), row0 + fragment_row(0, 2)};
    const int query[2] = {packing.query(packed[0]), packing.query(packed[1])};
    const int row_kv_head[2] = {packing.kv_head(packed[0]), packing.kv_head(packed[1])};
    // A row sees its own kv head's keys: -inf added to the elements of other heads' columns, the
    // same in every block (a block starts a token) and every n-tile (heads divide its 8 columns).
    static_assert(WARP_N % 8 == 0, "n-tiles of 8 columns");
    float other_heads[4] = {};
#pragma unroll
    for (int e = 0; e < 4; ++e)
        if (KV_HEADS && (fragment_col(0, e) & (heads - 1)) != row_kv_head[e / 2]) other_heads[e] = -CUPYFLASH_INF;
    typedef ScoreMods<BF16, FEATURES> Mods;
    const Mods mods[2] = {Mods(p, keys, batch, packing.head(packed[0])), Mods(p, keys, batch, packing.head(packed[1]))};

    float acc_o[1][DT][4];
    zero(acc_o);
    float row_max[1][2] = {{-CUPYFLASH_INF, -CUPYFLASH_INF}}, row_sum[1][2] = {{0.f, 0.f}};
    for (int buffer = 0; n_block < split_end; n_block += WARPS, buffer = buffer + 1 == STAGES ? 0 : buffer + 1) {
        const int ahead = n_block + (STAGES - 1) * WARPS;  // into the buffer the last step computed
        if (ahead < split_end) load(ahead, buffer == 0 ? STAGES - 1 : buffer - 1);
        else cp_async_commit();
        cp_async_wait<STAGES - 1>();
        __syncwarp();  // block n_block has landed, for every lane
        const uint16* s_k = s_buffers + buffer * 2 * WARP_N * L::kStride;
        const uint16* s_v = s_k + WARP_N * L::kStride;
        float s[1][NT][4];
        zero(s);
        warp_gemm<BF16, 1, NT, HEADDIM, HEADDIM, true, HEADDIM, true>(s, s_q, 0, s_k, 0);
        const int key0 = n_block * WARP_N;
        // Without a window every key of a whole block is visible: only the last block is masked.
        const bool whole = !LOCAL && key0 + WARP_N <= seqlen_v;
        auto score = [&](auto masked) {
            for_each_element<1, NT>([&](int, int nt, int e) {
                const int key = (key0 + fragment_col(nt, e)) >> head_shift, half = e / 2;  // (its token)
                float x = s[0][nt][e], grad = 1.f;  // (the forward needs no gradient)
                x = mods[half].apply(x, query[half], key, grad);
                s[0][nt][e] = !decltype(masked)::value || is_visible<LOCAL>(p, keys, query[half], key) ? x : -CUPYFLASH_INF;
            });
        };
        if (whole) score(Constant<false>());
        else score(Constant<true>());
        if constexpr (KV_HEADS) for_each_element<1, NT>([&](int, int nt, int e) { s[0][nt][e] += other_heads[e]; });
        softmax_step(s, acc_o, row_max, row_sum, p, 1.f);
        uint32 p_frag[WARP_N / 16][1][4];
#pragma unroll
        for (int kk = 0; kk < WARP_N / 16; ++kk) {
            p_frag[kk][0][0] = pack_pair<BF16>(s[0][2 * kk][0], s[0][2 * kk][1]);
            p_frag[kk][0][1] = pack_pair<BF16>(s[0][2 * kk][2], s[0][2 * kk][3]);
            p_frag[kk][0][2] = pack_pair<BF16>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
            p_frag[kk][0][3] = pack_pair<BF16>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
        }
        warp_gemm_a_in_registers<BF16, 1, DT, WARP_N, HEADDIM, false>(acc_o, p_frag, s_v, 0);
        __syncwarp();  // every lane is done with this buffer before the next load refills it
    }
    // The next kernel (the combine, or the next step's) may be placed now, to wait for this grid:
    // placed at the start its CTAs held SM slots this grid's later CTAs needed (16 x 1k hd64 -11%).
    allow_dependent_grid();

    // Merge the warps: O_w and sum_w scaled by 2^((max_w - max) scale_log2), the row's largest max.
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with its buffers, which now hold the merge
    float* s_o = reinterpret_cast<float*>(smem + T::kRows * L::kStride);  // [WARPS][kRows][HEADDIM]
    float* s_max = s_o + WARPS * T::kRows * HEADDIM;                       // [WARPS][kRows]
    float* s_sum = s_max + WARPS * T::kRows;                               // [WARPS][kRows]
    float* s_weight = s_sum + WARPS * T::kRows;                            // [kRows]: 1 / sum, then lse
    float* s_lse = s_weight + T::kRows;
    float* s_split_weights = s_lse + T::kRows;                             // [kRows][kClusterSplits]
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float sum = row_sum[0][half];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int r = fragment_row(0, 2 * half);
        if (lane % 4 == 0) {
            s_max[warp * T::kRows + r] = row_max[0][half];
            s_sum[warp * T::kRows + r] = sum;
        }
    }
    for_each_element<1, DT>([&](int, int dt, int e) {
        s_o[(warp * T::kRows + fragment_row(0, e)) * HEADDIM + fragment_col(dt, e)] = acc_o[0][dt][e];
    });
    __syncthreads();
    if (threadIdx.x < T::kRows) {  // per row: the warps' weights (into s_max), 1 / sum and lse
        const int r = threadIdx.x;
        float max = -CUPYFLASH_INF;
        for (int w = 0; w < WARPS; ++w) max = fmaxf(max, s_max[w * T::kRows + r]);
        const float offset = max == -CUPYFLASH_INF ? 0.f : max * p.scale_log2;
        float sum = 0.f;
        for (int w = 0; w < WARPS; ++w) {
            const float weight = fast_exp2(s_max[w * T::kRows + r] * p.scale_log2 - offset);
            s_max[w * T::kRows + r] = weight;
            sum += weight * s_sum[w * T::kRows + r];
        }
        s_weight[r] = sum > 0.f ? 1.f / sum : 0.f;
        s_lse[r] = sum > 0.f ? max * p.softmax_scale + logf(sum) : -CUPYFLASH_INF;
    }
    __syncthreads();
    const long long rows_total = static_cast<long long>(p.batch) * p.nheads * p.seqlen_q;
    for (int c = threadIdx.x; c < T::kRows * HEADDIM / 4; c += T::kThreads) {
        const int r = c / (HEADDIM / 4), col = 4 * (c % (HEADDIM / 4)), packed = row0 + r;
        if (packed >= rows || col >= p.headdim) continue;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int w = 0; w < WARPS; ++w) {
            const float weight = s_max[w * T::kRows + r] * s_weight[r];
            const float4 x = *reinterpret_cast<const float4*>(s_o + (w * T::kRows + r) * HEADDIM + col);
            o.x += weight * x.x; o.y += weight * x.y; o.z += weight * x.z; o.w += weight * x.w;
        }
        const int query_row = packing.query(packed), head = packing.head(packed);
        // (batch, head, query) of the statistics, and of the partials' rows
        const long long stats_row = (static_cast<long long>(batch) * p.nheads + head) * p.seqlen_q + query_row;
        if (p.num_splits == 1) {
            uint16* out = static_cast<uint16*>(p.out) + batch * p.out_batch_stride + query_row * p.out_row_stride
                          + head * p.out_head_stride + col;
            *reinterpret_cast<uint2*>(out) = make_uint2(pack_pair<BF16>(o.x, o.y), pack_pair<BF16>(o.z, o.w));
            if (col == 0) p.lse[stats_row] = s_lse[r];
        } else if (p.merge_in_cluster) {  // into warp 0's piece, which only this thread has read
            *reinterpret_cast<float4*>(s_o + r * HEADDIM + col) = o;
        } else {
            *reinterpret_cast<float4*>(p.out_partial + (split * rows_total + stats_row) * p.headdim + col) = o;
            if (col == 0) p.lse_partial[split * rows_total + stats_row] = s_lse[r];
        }
    }
    if (p.merge_in_cluster)
        merge_splits_in_cluster<BF16, HEADDIM, T::kRows, T::kThreads, T::kClusterSplits>(
            p, s_o, s_lse, s_split_weights, split, row0, rows, packing, batch);
}

// A CTA's reduction of one value per thread (op: fmaxf or a sum), its result in every thread.
template <typename Op>
__device__ __forceinline__ float block_reduce(float x, float* s_warps, Op op) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
    __syncthreads();  // s_warps is free (an earlier reduction's readers are done)
    if (threadIdx.x % 32 == 0) s_warps[threadIdx.x / 32] = x;
    __syncthreads();
    x = s_warps[0];
    for (int w = 1; w < blockDim.x / 32; ++w) x = op(x, s_warps[w]);
    return x;
}

// One CTA per (batch, head, query) row: out and lse from the splits' partials. Thread t adds the
// 4-float column t % (headdim / 4) of splits t / (headdim / 4), + groups, ..., so that a row of
// many splits (a short batch over a long cache) reads its partials in parallel rather than one
// split after another; the groups' sums meet in shared memory. Every split CTA writes its
// partial (zeros and lse -inf where it saw no key), so each is read, weighed 0 where it saw none.
template <bool BF16>
__device__ __forceinline__ void flash_decode_combine(const FlashParams& p) {
    __shared__ float4 s_sums[1024];  // a thread's sum each (up to the most threads a CTA has)
    __shared__ float s_warps[32];
    wait_for_prior_grid();  // the decode's partials (the next step is placed as its CTAs end: a combine has many waves)
    const long long rows_total = static_cast<long long>(p.batch) * p.nheads * p.seqlen_q;
    const long long row = blockIdx.x;
    const float* lse_partial = p.lse_partial + row;  // split s's at s * rows_total
    float max = -CUPYFLASH_INF;
    for (int s = threadIdx.x; s < p.num_splits; s += blockDim.x) max = fmaxf(max, lse_partial[s * rows_total]);
    max = block_reduce(max, s_warps, [](float a, float b) { return fmaxf(a, b); });
    float sum = 0.f;
    if (max != -CUPYFLASH_INF)
        for (int s = threadIdx.x; s < p.num_splits; s += blockDim.x) sum += __expf(lse_partial[s * rows_total] - max);
    sum = block_reduce(sum, s_warps, [](float a, float b) { return a + b; });
    const float lse = sum > 0.f ? max + logf(sum) : -CUPYFLASH_INF;

    const int chunks = p.headdim / 4, groups = blockDim.x / chunks, chunk = threadIdx.x % chunks;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (threadIdx.x < groups * chunks && lse != -CUPYFLASH_INF) {
#pragma unroll 4
        for (int s = threadIdx.x / chunks; s < p.num_splits; s += groups) {
            const float lse_s = lse_partial[s * rows_total];
            const float weight = lse_s == -CUPYFLASH_INF ? 0.f : __expf(lse_s - lse);
            const float4 x = *reinterpret_cast<const float4*>(p.out_partial + (s * rows_total + row) * p.headdim
                                                              + 4 * chunk);
            o.x += weight * x.x; o.y += weight * x.y; o.z += weight * x.z; o.w += weight * x.w;
        }
    }
    s_sums[threadIdx.x] = o;
    __syncthreads();
    if (threadIdx.x < chunks) {
        for (int g = 1; g < groups; ++g) {
            const float4 x = s_sums[g * chunks + threadIdx.x];
            o.x += x.x; o.y += x.y; o.z += x.z; o.w += x.w;
        }
        const int query = row % p.seqlen_q, head = (row / p.seqlen_q) % p.nheads;
        const int batch = row / (static_cast<long long>(p.seqlen_q) * p.nheads);
        uint16* out = static_cast<uint16*>(p.out) + batch * p.out_batch_stride + query * p.out_row_stride
                      + head * p.out_head_stride + 4 * threadIdx.x;
        *reinterpret_cast<uint2*>(out) = make_uint2(pack_pair<BF16>(o.x, o.y), pack_pair<BF16>(o.z, o.w));
    }
    if (threadIdx.x == 0) p.lse[row] = lse;
}
