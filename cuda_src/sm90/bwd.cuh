// Backward pass on Hopper (sm_90a): what sm80/bwd.cuh's flash_bwd computes, on wgmma and TMA,
// between the same row kernels (flash_bwd_dot before it, flash_bwd_convert_dq after but where the
// keys are one block: then each step's dQ is whole, and the kernel stores it in dq). FEATURES
// adds the score options of common/score.cuh that a call uses (softcap, ALiBi, attn_bias with
// dbias, dropout); DETERMINISTIC kernels add dQ in key-block order (a counter
// per query block, as sm80's).
//
// One CTA per (key block of BLOCK_N keys, kv head, batch), in grid_slot's order. (hd256 splits
// the work between its consumers otherwise: see the hd256 branch of the consumers below.) The first
// warpgroup is the producer: one thread loads K and V once, then for each step (a query block of
// BLOCK_M rows, of every query head of the kv group in turn, as sm80) its Q and dO (and its bias
// tile, kBiasTiles) by TMA and its rows' lse_log2 and D by bulk copies, into a ring of STAGES buffers. Two consumer warpgroups own
// 64 keys each and compute, per step, in the transposed orientation (keys are the rows, so that
// P^T and dS^T are the A operands of dV and dK straight from the accumulators):
//   S^T = K Q^T, dP^T = V dO^T (wgmma, shared memory)
//   -> P^T = 2^(S^T scale_log2 - lse_log2), dS^T = P^T (dP^T - D) (lse_log2 and D per column)
//   -> dV += P^T dO, dK += dS^T Q (wgmma, A from registers, dO and Q read N-major)
// and store dS^T to shared memory, from which dQ = dS K is a product with both operands read
// MN-major: at hd128 each consumer computes half of dQ's columns, at hd64 on 128-row steps half of
// its rows, over all BLOCK_N keys (after a barrier of the two); on hd64's 64-row steps (the
// options') all of dQ over its own 64 keys. The products go out as three groups, dV, dQ, dK, so
// that dQ is stored while dK runs. The consumers leave dQ in shared memory in dq_accum's layout
// (the 80-row step's in its accumulators' order, common/mask.cuh dq_accum_fragment_index, which
// flash_bwd_convert_dq reads back), and a second producer thread adds it to dq_accum by bulk
// reductions (the copy engine's, off the consumers' path). Rows past a sequence's end have lse_log2 = +inf (flash_bwd_dot pads them), so
// their P is 0 and no query-side mask is needed; keys past its end and causal or window edges are
// masked.
#pragma once
#include "../common/fragment.cuh"
#include "../common/mask.cuh"
#include "../common/math.cuh"
#include "../common/score.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

// Four 8 x 8 matrices stored transposed (stmatrix's fragments): lane l's address names row l % 8 of
// matrix l / 8's transpose (a column of the fragment's matrix).
__device__ __forceinline__ void stmatrix_x4_trans(uint32 addr, uint32 r0, uint32 r1, uint32 r2, uint32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// Tensor maps of q, k, v and dout, 4-D as the forward's (FwdMaps): boxes of 64 columns by
// BLOCK_M (q, dout) or BLOCK_N (k, v) rows; and the attn_bias's as the forward's (boxes of 64 keys
// by BLOCK_M rows), where the kernel has bias tiles.
struct BwdMaps {
    TensorMap q, k, v, dout, bias;
};

template <int HEADDIM, int BLOCK_M, int BLOCK_N, int STAGES, bool BIAS_TILES = false, bool DROPOUT = false>
struct Sm90BwdTile {
    // Up to hd128 the consumers split the keys (64 each); at hd256, whose dK and dV of 64 keys would
    // take all of a consumer's registers, both work on BLOCK_N = 64 keys and split dK's and dV's
    // columns: one computes S^T, the other dP^T, and they trade through shared memory.
    static constexpr bool kSplitKeys = HEADDIM <= 128;
    static constexpr int kConsumers = 2;
    static constexpr int kThreads = 128 * (1 + kConsumers);
    // hd128 on 80 query rows a step (no causal or window edge, no options): dQ^T = K^T dS^T, each
    // consumer 64 of dQ's columns as the rows of its product (wgmma's N is the 80 queries), dS
    // stored query-major (transposed by stmatrix) as that product's K-major B operand.
    static constexpr bool kDQTransposed = HEADDIM == 128 && BLOCK_M == 80;
    // Registers per thread: hd128's consumers hold dK and dV (128) besides S^T, dP^T and dQ; hd64's
    // need fewer, and the producer's two threads use more there. A CTA starts with kLaunchRegisters
    // per thread (65536 / kThreads, as ptxas rounds it) and setmaxnreg only moves them between
    // warpgroups: a consumer that asks for more than the producer gave up waits for ever.
    static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
    // hd64 on 128 query rows a step holds S^T and dP^T of 64 keys x 128 queries (64 registers each);
    // hd128 on 80 rows spills at 232 (dQ^T's 80 columns), so its producer keeps 24 (as FA3's).
    static constexpr int kConsumerRegisters = HEADDIM == 64 && BLOCK_M == 64 ? 224 : kDQTransposed ? 240 : 232;
    static constexpr int kProducerRegisters = HEADDIM == 64 && BLOCK_M == 64 ? 56 : kDQTransposed ? 24 : 40;
    static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= (1 + kConsumers) * kLaunchRegisters,
                  "the consumers' registers are the producer's");
    static constexpr int kKVBytes = BLOCK_N * HEADDIM * 2;     // K or V
    static constexpr int kQBytes = BLOCK_M * HEADDIM * 2;      // Q or dO, per stage
    static constexpr int kDSBytes = BLOCK_N * BLOCK_M * 2;     // dS^T (or P^T), 16-bit
    static constexpr int kRowBytes = BLOCK_M * 4;              // lse_log2 or D, per stage
    // hd128: dQ's columns split over the consumers; hd64 on 128 query rows: dQ's rows. Either
    // way each consumer's part spans all BLOCK_N keys (a barrier of the two per step) and a step
    // adds one piece. hd64 on 64 rows: each consumer takes its own keys' part of dQ (two pieces to
    // add, no barrier between them).
    static constexpr bool kSplitDQColumns = HEADDIM == 128;
    static constexpr bool kSplitDQRows = HEADDIM == 64 && BLOCK_M == 128;
    static constexpr int kDQPieces = kSplitDQColumns || kSplitDQRows ? 1 : kConsumers;
    static constexpr int kDQBytes = BLOCK_M * HEADDIM * 4;     // one piece of dQ, fp32
    // Where the keys are one block (p.dq_stored_by_bwd) a step's dQ is whole, and the consumers store
    // it from their registers where each holds whole values in rows: at hd256, and up to hd128 where
    // dQ is one piece, untransposed (Tile.can_store_dq in cupyflash/_config.py).
    static constexpr bool kCanStoreDQ = !kSplitKeys || (kDQPieces == 1 && !kDQTransposed);
    static constexpr int kDPBytes = BLOCK_N * BLOCK_M * 4;     // hd256: dP^T, fp32
    // What the consumers trade per step: two dS^T buffers and dQ (split keys), or P^T, dS^T and
    // dP^T (hd256, whose dQ goes to dq_accum by reductions from registers).
    static constexpr int kTradeBytes = kSplitKeys ? 2 * kDSBytes + kDQPieces * kDQBytes : 2 * kDSBytes + kDPBytes;
    // Dropout's decisions of a step, a word per consumer thread, wait in shared memory for dS^T
    // (split keys): kept in a register through the step, the LOCAL kernels spill. (hd256 keeps
    // them in a register, and its tile fills the 227 KiB.)
    static constexpr int kKeptBytes = DROPOUT && kSplitKeys && BLOCK_M == 64 ? 128 * kConsumers * 4 : 0;
    static constexpr int kBarrierBytes = 8 * (3 + 2 * STAGES);
    // A kernel whose attn_bias comes in tiles (BIAS_TILES, as the forward's) has a ring of them beside
    // Q's (BLOCK_M rows by BLOCK_N keys, 16-bit, in 64-key column blocks: a consumer's keys each),
    // copied with Q. Other biases are read by the consumers element by element, their latency in
    // every step.
    static constexpr int kBiasTileBytes = BLOCK_M * BLOCK_N * 2;
    static constexpr int smem_bytes_with(bool bias_tiles) {
        return 1024 + 2 * kKVBytes + STAGES * 2 * kQBytes + kTradeBytes + (bias_tiles ? STAGES * kBiasTileBytes : 0)
               + STAGES * 2 * kRowBytes + kKeptBytes + kBarrierBytes;
    }
    static constexpr bool kBiasTiles = BIAS_TILES;
    static_assert(!BIAS_TILES || (kSplitKeys && smem_bytes_with(true) <= 227 * 1024),
                  "the ring of bias tiles fits, a consumer's 64 keys a column block");
    // Tiles first (each a multiple of 1024 bytes, as the swizzle needs), then the rows' floats and
    // the barriers; the dynamic shared memory's start is aligned up to 1024 bytes in the kernel.
    static constexpr int kSmemBytes = smem_bytes_with(kBiasTiles);
    static_assert(kSplitKeys ? (HEADDIM == 64 || HEADDIM == 128) && BLOCK_N == 128 : HEADDIM == 256 && BLOCK_N == 64,
                  "64 keys by HEADDIM (split keys) or by HEADDIM / 2 (hd256) of dK and dV per consumer");
    static_assert(BLOCK_M == 64 || kSplitDQRows || kDQTransposed,
                  "S^T is 64 keys by 64 queries per consumer (hd64: or by 128; hd128: or by 80)");
};

// Dropout's decisions of a consumer thread's whole step of S^T (keys as rows from warp_key0, queries
// as columns from row0; BLOCK_M / 8 tiles of 8 query columns, 4 bits each: element e of tile nt at
// bit 4 nt + e), one word: drawn while the step's products run, the Philox calls beside the tensor
// cores, and none of their temporaries live through the step. They are the forward's
// (common/score.cuh, kDropoutBits): transposed, a group's lanes hold keys j and j ^ 1, and each
// draws every other group of 16 queries.
template <int BLOCK_M>
__device__ __forceinline__ uint32 step_dropout_bits(const FlashParams& p, int batch, int head, int row0, int warp_key0) {
    static_assert(BLOCK_M / 8 * 4 <= 32 && BLOCK_M % 32 == 0, "a step's decisions are one word, its groups pairs");
    const unsigned long long seed = dropout_seed(p);
    const uint32 keep_max = static_cast<uint32>(p.dropout_keep_max);
    const int g = threadIdx.x % 32 / 4, parity = g & 1;
    uint32 bits = 0;
    const auto decide = [&](int k, uint2 words) {  // element e of tile 2 k + n: (j bit 3, i bit 0) = (e / 2, e % 2)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                bits |= uint32(dropout_kept(e % 2 ? words.y : words.x, 2 * n + e / 2, keep_max)) << (8 * k + 4 * n + e);
    };
#pragma unroll
    for (int k = 0; k < BLOCK_M / 16; k += 2) {
        const uint4 drawn = philox4x32_10(make_uint4(warp_key0 + (g & ~1), row0 + 16 * (k + parity) + 2 * (threadIdx.x % 4),
                                                     batch * p.nheads + head, 0), seed);
        uint2 group0, group1;
        trade_dropout_words<false>(drawn, parity, group0, group1);
        decide(k, group0);
        decide(k + 1, group1);
    }
    return bits;
}

// P^T of COUNT 8-column tiles from nt0 of a consumer's S^T (keys as rows from warp_key0, queries as
// columns from row0; lse indexed by the column): the modifiers applied (grad times their d/ds), the
// bias from `bias_tile` where it is not 0 (the step's, this consumer's 64 keys, this warp's 16 from
// `tile_key0`), exponentiated, masked.
template <bool BF16, bool LOCAL, int FEATURES, int COUNT, int MT>
__device__ __forceinline__ void probabilities_transposed(float (&s)[MT][4], float (&grad)[COUNT][4], int nt0,
                                                         const FlashParams& p, const Sequence& seq, int batch, int head,
                                                         int row0, int warp_key0, bool masked, const float* lse,
                                                         uint32 bias_tile = 0, int tile_key0 = 0) {
    if constexpr (softcap_folds<FEATURES>()) {
        // Softcap alone: the scores stay tanh values and its outer factor goes to the exps' scale
        // (score_unit, as the forward's), a multiply fewer an element.
        const Softcap softcap(p, seq, batch, head);
        if (softcap.on())
            for_each_element<1, COUNT>([&](int, int c, int e) {
                s[nt0 + c][e] = softcap.tanh_part(s[nt0 + c][e], grad[c][e]);
            });
    } else if constexpr (FEATURES != 0) {
        // Modifier by modifier: one branch each, where per element ptxas predicates every
        // modifier's code at once. Set up from the parameters here (a few integer operations):
        // held through the step, their pointers and strides make the hd128 kernel spill.
        const ScoreMods<BF16, FEATURES> mods(p, seq, batch, recomputed(head), bias_tile != 0);
        mods.for_each([&](const auto& mod) {
            for_each_element<1, COUNT>([&](int, int c, int e) {
                const int nt = nt0 + c;
                s[nt][e] = mod.apply(s[nt][e], row0 + fragment_col(nt, e), warp_key0 + fragment_row(0, e), grad[c][e]);
            });
        });
    }
    if ((FEATURES & feature::bias) != 0 && bias_tile != 0)
        add_swizzled_tile_transposed<BF16, COUNT>(s, nt0, bias_tile, tile_key0, p.inv_softmax_scale, p.bias_box_rows == 1);
    // Hidden scores are -inf before the exps (lse_log2 is +inf only for a row that sees no key, so
    // each gives 0), which keeps the mask's branch ahead of the exps, not between them and P's packs.
    if (masked) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
            hide_unseen<COUNT>(s, nt0, half, queries_seeing<LOCAL>(p, seq, warp_key0 + fragment_row(0, 2 * half),
                                                                   row0 + fragment_col(nt0, 0)), -CUPYFLASH_INF);
    }
    const float scale_log2 = p.scale_log2 * score_unit<FEATURES>(p);
    for_each_element<1, COUNT>([&](int, int c, int e) {
        const int nt = nt0 + c;
        s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -lse[fragment_col(nt, e)]));
    });
}

// dS^T of one tile from its P^T (s) and dP^T (dp; dot indexed by the column): dp becomes the
// gradient of the raw scores, dS^T times the modifiers' d/ds (grad), and s the P^T that dV needs
// (dropped and rescaled where dropout is on: `kept`, the tile's four decisions); dS^T goes to dbias
// (BiasGradient) where the call returns it.
template <bool BF16, int FEATURES>
__device__ __forceinline__ void gradients_transposed(float (&s)[4], float (&dp)[4], const float (&grad)[4], int nt,
                                                     const FlashParams& p, const Sequence& seq, int batch, int head,
                                                     int row0, int warp_key0, const float* dot, uint32 kept) {
    const float keep_scale = p.dropout_scale != 0.f ? p.dropout_scale : 1.f;
    const BiasGradient<BF16> dbias(p, batch, head);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        // Dropout: dV sees the kept P times p.dropout_scale, and the gradient reaching P is dP times the same.
        const float drop = (FEATURES & feature::dropout) == 0 ? 1.f : ((kept >> e) & 1 ? keep_scale : 0.f);
        const float ds = s[e] * (dp[e] * drop - dot[fragment_col(nt, e)]);
        if constexpr ((FEATURES & feature::bias) != 0) {
            const int row = row0 + fragment_col(nt, e), key = warp_key0 + fragment_row(0, e);
            if (dbias.matrix != nullptr && row < seq.seqlen_q && key < seq.seqlen_k) dbias.add(row, key, ds);
        }
        s[e] *= drop;
        dp[e] = ds * grad[e];
    }
}

// A LOCAL backward's dbias rows that no step of this key block writes (the query rows outside the
// blocks of `seen`, of every head of the kv group), zeroed by `threads` threads from `t` in 16-byte
// stores where p.dbias_zero_unseen says so (one writer an element, rows on 16-byte boundaries), so
// that the plan need not zero the whole matrix first. Not inlined: inlined, its registers beside the
// producer's spill the LOCAL hd128 kernel.
template <int BLOCK_M, int BLOCK_N>
__device__ __noinline__ void zero_unseen_dbias(const FlashParams& p, int seqlen_q, int seqlen_k, int batch,
                                               int first_head, int group, int key0, BlockRange seen, int t,
                                               int threads) {
    const int element_bytes = p.dbias_is_float32 ? 4 : 2;
    const int chunks = BLOCK_N * element_bytes / 16, chunk = t % chunks;  // (threads: a multiple of chunks)
    if (chunk * 16 >= (seqlen_k - key0) * element_bytes) return;  // (the last key block's)
    const int seen_begin = seen.first * BLOCK_M, seen_end = max(seen_begin, min(seen.end * BLOCK_M, seqlen_q));
    const long long row_bytes = p.dbias_row_stride * element_bytes;
    const int rows_a_pass = threads / chunks;
#pragma unroll 1
    for (int head = first_head; head < first_head + group; ++head) {
        char* const matrix = static_cast<char*>(p.dbias) + chunk * 16 +
                             (batch * p.dbias_batch_stride + head * p.dbias_head_stride + key0) * element_bytes;
#pragma unroll 1
        for (int row = t / chunks; row < seqlen_q; row += rows_a_pass) {
            if (row >= seen_begin && row < seen_end) row += seen_end - seen_begin;  // (a multiple of rows_a_pass)
            if (row < seqlen_q) st_global_u128(matrix + row * row_bytes, make_uint4(0, 0, 0, 0));
        }
    }
}

// dK (times the softmax scale) and dV of a consumer warpgroup's 64 keys from key0 and TILES column
// tiles from col0, through shared memory (stage_rows; stage_dk, stage_dv) to 16-byte global stores.
// dk and dv are the plan's own arrays: rows 16-byte aligned.
template <bool BF16, int TILES>
__device__ __forceinline__ void store_dk_dv(const FlashParams& p, const Sequence& seq, int batch, int head_k, int key0,
                                            int col0, const float (&acc_dk)[1][TILES][4],
                                            const float (&acc_dv)[1][TILES][4], uint32 stage_dk, uint32 stage_dv) {
    stage_rows<BF16>(stage_dk, acc_dk, p.softmax_scale);
    stage_rows<BF16>(stage_dv, acc_dv, 1.f);
    __syncwarp();
    uint16* dk = static_cast<uint16*>(p.dk) + batch * p.dk_batch_stride + head_k * p.dk_head_stride
                 + seq.first_row_k * p.dk_row_stride;
    uint16* dv = static_cast<uint16*>(p.dv) + batch * p.dv_batch_stride + head_k * p.dv_head_stride
                 + seq.first_row_k * p.dv_row_stride;
    for_each_staged_chunk<TILES>([&](int row, int chunk, uint32 offset) {
        const int key = key0 + row, col = col0 + 8 * chunk;
        const uint4 dk_chunk = ld_shared_u128(stage_dk + offset), dv_chunk = ld_shared_u128(stage_dv + offset);
        if (key < seq.seqlen_k && col < p.headdim) {
            st_global_u128(dk + key * p.dk_row_stride + col, dk_chunk);
            st_global_u128(dv + key * p.dv_row_stride + col, dv_chunk);
        }
    });
}

// The sequence's first row of dq at (batch, head), where a backward of one key block stores dQ
// (p.dq_stored_by_bwd). dq is the plan's own array: rows 16-byte aligned.
__device__ __forceinline__ uint16* dq_rows_of(const FlashParams& p, const Sequence& seq, int batch, int head) {
    return static_cast<uint16*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride
           + seq.first_row_q * p.dq_row_stride;
}

template <int HEADDIM, int BLOCK_M, int BLOCK_N, int STAGES, bool BF16, bool LOCAL, int FEATURES, bool DETERMINISTIC,
          bool BIAS_TILES>
__device__ __forceinline__ void flash_bwd_sm90(const FlashParams& p, const BwdMaps& maps) {
    constexpr bool DROPOUT = (FEATURES & feature::dropout) != 0;
    typedef Sm90BwdTile<HEADDIM, BLOCK_M, BLOCK_N, STAGES, BIAS_TILES, DROPOUT> T;
    static_assert(!BIAS_TILES || (FEATURES & feature::bias) != 0, "bias tiles are an attn_bias's");
    // P^T is computed while dP^T's product runs (its elements then wait for dP^T); softcap's d/ds
    // would wait with them, and the LOCAL hd128 kernel's pointers to a bias in global memory spill
    // beside dP^T's accumulators: there each tile's P^T, d/ds and dS^T in one pass after both products.
    constexpr bool kEarlyProbabilities =
        (FEATURES & feature::softcap) == 0 && !((FEATURES & feature::bias) != 0 && !T::kBiasTiles && LOCAL && HEADDIM == 128);
    constexpr int DT = HEADDIM / 8, MT = BLOCK_M / 8;  // accumulator column tiles: of dK/dV, of S^T
    // (The 80-row tile's last block, which may reach past the rows that flash_bwd_dot pads, stays
    // inside its sequence's padded rows: a head's are whole blocks, a varlen sequence's gap 128 rows.)
    static_assert(BLOCK_M % Sequence::kPaddedRows == 0 || T::kDQTransposed, "a query block starts a sequence's padded rows' piece");
    static_assert(BLOCK_M == 64 || !DROPOUT, "a step's dropout decisions are one word: 64 query rows");
    static_assert(!T::kDQTransposed || (!LOCAL && FEATURES == 0),
                  "the 80-row tile serves calls without score options, causal or window edges");
    constexpr int kDQWidth = T::kSplitDQColumns ? HEADDIM / T::kConsumers : HEADDIM;
    const bool stores_dq = T::kCanStoreDQ && p.dq_stored_by_bwd;  // (else adds into dq_accum)

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32 s_k = (smem_address(smem_raw) + 1023) & ~1023u, s_v = s_k + T::kKVBytes;
    auto s_q = [&](int stage) { return s_v + T::kKVBytes + stage * 2 * T::kQBytes; };
    auto s_do = [&](int stage) { return s_q(stage) + T::kQBytes; };
    static_assert(STAGES >= 2 && 64 * 2 * (T::kSplitKeys ? HEADDIM : HEADDIM / 2) <= T::kQBytes,
                  "consumer c's dK and dV (64 keys, its columns) fit stage c's Q and dO buffers (store_dk_dv)");
    const uint32 s_trade = s_q(STAGES);
    auto s_bias = [&](int stage) { return s_trade + T::kTradeBytes + stage * T::kBiasTileBytes; };
    const uint32 s_rows = s_bias(T::kBiasTiles ? STAGES : 0);
    auto s_ds = [&](int buffer) { return s_trade + buffer * T::kDSBytes; };  // hd256: P^T is buffer 0, dS^T 1
    const uint32 s_dq = s_ds(2), s_dp = s_ds(2);  // (split keys: dQ; hd256: dP^T)
    auto s_lse = [&](int stage) { return s_rows + stage * 2 * T::kRowBytes; };
    auto s_dot = [&](int stage) { return s_lse(stage) + T::kRowBytes; };
    const uint32 s_kept = s_rows + STAGES * 2 * T::kRowBytes + 4 * (threadIdx.x - 128);  // (a consumer thread's)
    const uint32 kv_full = s_rows + STAGES * 2 * T::kRowBytes + T::kKeptBytes;
    auto q_full = [&](int stage) { return kv_full + 8 * (1 + stage); };
    auto q_empty = [&](int stage) { return kv_full + 8 * (1 + STAGES + stage); };
    const uint32 dq_full = kv_full + 8 * (1 + 2 * STAGES), dq_empty = dq_full + 8;

    const GridSlot slot = grid_slot<LOCAL, true>(p);
    const int n_block = slot.block, head_k = slot.head, batch = slot.batch;
    const int key0 = n_block * BLOCK_N;
    const Sequence seq(p, batch);
    if (key0 >= seq.seqlen_k) return;  // a varlen grid covers the longest sequence
    const int group = p.nheads / p.nheads_k;
    const BlockRange query_blocks = query_blocks_seeing<LOCAL>(p, seq, key0, BLOCK_M, BLOCK_N);
    const int steps = group * (query_blocks.end - query_blocks.first);
    const QueryWalk<BLOCK_M, DETERMINISTIC, LOCAL> walk{query_blocks};
    const int first_head = head_k * group, first_row0 = walk.first_row0();

    const int warpgroup = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        mbarrier_init(kv_full, 2);  // K, V
#pragma unroll
        for (int stage = 0; stage < STAGES; ++stage) {
            mbarrier_init(q_full(stage), 4);               // Q, dO, lse_log2, D
            // Every consumer thread arrives: each orders its own reads of lse_log2 and D before the
            // producer's next copies into the stage.
            mbarrier_init(q_empty(stage), 128 * T::kConsumers);
        }
        mbarrier_init(dq_full, 4 * T::kConsumers);
        mbarrier_init(dq_empty, 1);
        fence_mbarrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        setmaxnreg_dec<T::kProducerRegisters>();
        if (T::kSplitKeys && !stores_dq && threadIdx.x == 32) {  // dQ's adder
            const auto add_step = [&](int step, int head, int row0) {
                mbarrier_wait(dq_full, step & 1);
                float* dq_accum = p.dq_accum + (seq.padded_row0(p, batch, head, T::kDQTransposed) + row0) * HEADDIM;
                int* counter = nullptr;
                if constexpr (DETERMINISTIC) {  // this key block's turn among those the query block sees
                    counter = dq_turn_counter(p, batch, head, row0 / BLOCK_M);
                    const int turn = n_block - key_blocks_seen<LOCAL>(p, seq, row0, BLOCK_M, BLOCK_N).first;
                    while (load_acquire(counter) != turn) {}
                    fence_proxy_async_global();  // the earlier blocks' adds, then this one's reductions
                }
#pragma unroll
                for (int piece = 0; piece < T::kDQPieces; ++piece) {
                    bulk_reduce_add(dq_accum, s_dq + piece * T::kDQBytes, T::kDQBytes);
                    if constexpr (DETERMINISTIC) {  // each piece complete before the next: a fixed order of adds
                        bulk_commit();
                        bulk_wait_all<false>();
                    }
                }
                if constexpr (DETERMINISTIC) {
                    fence_proxy_async_global();
                    add_release(counter, 1);
                } else {
                    bulk_commit();
                    bulk_wait_all<true>();
                }
                mbarrier_arrive(dq_empty);
            };
            // (unrolled, the 80-row tile's loop spills at 24 registers; the others lose 1-3% rolled)
            int head = first_head, row0 = first_row0;
            if constexpr (T::kDQTransposed) {
#pragma unroll 1
                for (int step = 0; step < steps; ++step, walk.advance(head, row0)) add_step(step, head, row0);
            } else {
                for (int step = 0; step < steps; ++step, walk.advance(head, row0)) add_step(step, head, row0);
            }
            bulk_wait_all<false>();
        }
        if constexpr (LOCAL && (FEATURES & feature::bias) != 0) {
            if (threadIdx.x >= 64 && p.dbias_zero_unseen)  // warps 2 and 3, idle but for this
                zero_unseen_dbias<BLOCK_M, BLOCK_N>(p, seq.seqlen_q, seq.seqlen_k, batch, first_head, group, key0,
                                                    query_blocks, threadIdx.x - 64, 64);
        }
        if (threadIdx.x != 0) return;
        const int batch_coord = p.cu_seqlens_q == nullptr ? batch : 0;
        load_tile<BLOCK_N, HEADDIM>(s_k, &maps.k, kv_full, seq.first_row_k + key0, head_k, batch_coord);
        load_tile<BLOCK_N, HEADDIM>(s_v, &maps.v, kv_full, seq.first_row_k + key0, head_k, batch_coord);
        int head = first_head, row0 = first_row0;
        for (int step = 0; step < steps; ++step, walk.advance(head, row0)) {
            const int stage = step % STAGES;
            if (step >= STAGES) mbarrier_wait(q_empty(stage), ((step / STAGES) & 1) ^ 1);
            load_tile<BLOCK_M, HEADDIM>(s_q(stage), &maps.q, q_full(stage), seq.first_row_q + row0, head, batch_coord,
                                        T::kBiasTiles ? p.bias_box_rows * BLOCK_N * 2 : 0);
            if constexpr (T::kBiasTiles) {  // (its bytes are q_full's too)
                const int3 at = Bias<BF16>::map_coordinates(p, batch, head, row0);
                copy_column_blocks<BLOCK_M, BLOCK_N>(s_bias(stage), &maps.bias, q_full(stage), key0, at.x, at.y, at.z);
            }
            load_tile<BLOCK_M, HEADDIM>(s_do(stage), &maps.dout, q_full(stage), seq.first_row_q + row0, head,
                                        batch_coord);
            const long long padded_row = seq.padded_row0(p, batch, head, T::kDQTransposed) + row0;
            bulk_load(s_lse(stage), p.lse_log2 + padded_row, T::kRowBytes, q_full(stage));
            bulk_load(s_dot(stage), p.dout_dot_out + padded_row, T::kRowBytes, q_full(stage));
        }
        return;
    }

    setmaxnreg_inc<T::kConsumerRegisters>();
    // Broadcast from lane 0, the compiler knows it is the same across the warp and keeps what derives
    // from it (the wgmma descriptors, shared-memory bases) in uniform registers: about 100 fewer
    // instructions a step at 64 rows, and at 80 (whose registers are free for it since dQ^T leaves
    // in its fragments' order).
    const int consumer = __shfl_sync(0xffffffffu, warpgroup - 1, 0);
    if constexpr (!T::kSplitKeys) {
        // hd256: both consumers on all BLOCK_N keys, consumer c owning dK's and dV's columns
        // [128 c, 128 c + 128). Per step, consumer 1 computes dP^T and leaves it in shared memory
        // (fp32, each thread's elements where the same thread of consumer 0 reads them); consumer 0
        // computes S^T, P^T and dS^T and stores P^T and dS^T (16-bit, swizzled, keys as rows); both
        // then run their columns' dV += P^T dO, dK += dS^T Q and dQ = dS K (added to dq_accum by
        // reductions from registers). Named barriers: 1, dP^T stored; 2, P^T and dS^T stored (both
        // consumers); 3, consumer 1's products of the last step are done with P^T and dS^T.
        constexpr int kHalf = HEADDIM / 2, HT = kHalf / 8;
        const int warp_key0 = key0 + 16 * (threadIdx.x / 32 % 4);
        const int lane_row = 16 * (threadIdx.x / 32 % 4) + (threadIdx.x % 32) / 4;  // a warp's first row + g
        float acc_dk[1][HT][4], acc_dv[1][HT][4];
        zero(acc_dk);
        zero(acc_dv);
        mbarrier_wait(kv_full, 0);
        int head = first_head, row0 = first_row0;
        for (int step = 0; step < steps; ++step, walk.advance(head, row0)) {
            const int stage = step % STAGES;
            if ((FEATURES & feature::bias) != 0 && consumer == 0)  // the step's bias reads then wait on L1
                Bias<BF16>(p, seq, batch, recomputed(head)).prefetch<BLOCK_M, BLOCK_N>(row0, key0);
            mbarrier_wait(q_full(stage), (step / STAGES) & 1);
            float x[1][MT][4];  // S^T (consumer 0) or dP^T (consumer 1)
            wgmma_fence();
            const uint64 a_desc = k_major_descriptor(consumer == 0 ? s_k : s_v, 0, BLOCK_N);
            const uint64 b_desc = k_major_descriptor(consumer == 0 ? s_q(stage) : s_do(stage), 0, BLOCK_M);
            static_for<HEADDIM / 16>([&](auto kk_) {
                constexpr int kk = decltype(kk_)::value;
                wgmma_ss<BLOCK_M, BF16>(flat(x), descriptor_plus<k_major_offset(kk, BLOCK_N), false>(a_desc),
                                        descriptor_plus<k_major_offset(kk, BLOCK_M), false>(b_desc), kk > 0);
            });
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(flat(x));
            float* dp_slot = reinterpret_cast<float*>(smem_raw + (s_dp - smem_address(smem_raw))) + 2 * (threadIdx.x % 128);
            if (consumer == 1) {
#pragma unroll
                for (int nt = 0; nt < MT; ++nt)
#pragma unroll
                    for (int half = 0; half < 2; ++half)
                        *reinterpret_cast<float2*>(dp_slot + 256 * (2 * nt + half)) =
                            make_float2(x[0][nt][2 * half], x[0][nt][2 * half + 1]);
                consumers_arrive(1);
            } else {
                const float* lse = reinterpret_cast<const float*>(smem_raw + (s_lse(stage) - smem_address(smem_raw)));
                const float* dot = reinterpret_cast<const float*>(smem_raw + (s_dot(stage) - smem_address(smem_raw)));
                const bool masked = block_needs_mask<LOCAL>(p, seq, row0, key0, BLOCK_M, BLOCK_N);
                uint32 kept = ~0u;  // dropout's decisions: tile nt's at bit 4 nt (all kept where dropout is off)
                if constexpr (kEarlyProbabilities) {  // P^T while consumer 1 stores dP^T
                    float no_grad[MT][4];
                    for_each_element<1, MT>([&](int, int nt, int e) { no_grad[nt][e] = 1.f; });
                    probabilities_transposed<BF16, LOCAL, FEATURES>(x[0], no_grad, 0, p, seq, batch, head, row0, warp_key0,
                                                                    masked, lse);
                }
                if (DROPOUT && p.dropout_scale != 0.f) kept = step_dropout_bits<BLOCK_M>(p, batch, head, row0, warp_key0);
                consumers_sync(1);  // dP^T is stored
                if (step > 0) consumers_sync(3);  // consumer 1 is done with the last step's P^T and dS^T
#pragma unroll
                for (int nt = 0; nt < MT; ++nt) {
                    float dp[4], grad[1][4] = {{1.f, 1.f, 1.f, 1.f}};
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const float2 pair = *reinterpret_cast<const float2*>(dp_slot + 256 * (2 * nt + half));
                        dp[2 * half] = pair.x;
                        dp[2 * half + 1] = pair.y;
                    }
                    if constexpr (!kEarlyProbabilities)  // the modifiers' d/ds live for one tile only
                        probabilities_transposed<BF16, LOCAL, FEATURES>(x[0], grad, nt, p, seq, batch, head, row0,
                                                                        warp_key0, masked, lse);
                    gradients_transposed<BF16, FEATURES>(x[0][nt], dp, grad[0], nt, p, seq, batch, head, row0, warp_key0, dot,
                                                         kept >> (4 * nt));
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const uint32 offset = swizzled_offset(lane_row + 8 * half, fragment_col(nt, 0), BLOCK_N);
                        st_shared_u32(s_ds(0) + offset, pack_pair<BF16>(x[0][nt][2 * half], x[0][nt][2 * half + 1]));
                        st_shared_u32(s_ds(1) + offset, pack_pair<BF16>(dp[2 * half], dp[2 * half + 1]));
                    }
                }
                fence_proxy_async();  // P^T's and dS^T's stores, then wgmma reads them
            }
            consumers_sync(2);  // P^T and dS^T are stored

            // Four groups: dV += P^T dO, dQ = dS K in two 64-column chunks, dK += dS^T Q, so that each
            // chunk's reductions are issued while the later products run. dV and dK over this
            // consumer's columns: A K-major (keys as rows, queries contiguous), B N-major (two 64-wide
            // column blocks of dO and Q). dQ: A dS^T's tile read MN-major, B the K tile read N-major.
            static_assert(kHalf == 128, "dQ in two 64-column chunks");
            const uint64 p_desc = k_major_descriptor(s_ds(0), 0, BLOCK_N), ds_desc = k_major_descriptor(s_ds(1), 0, BLOCK_N);
            const uint64 do_desc = n_major_descriptor(s_do(stage) + 2 * consumer * BLOCK_M * kSwizzleRowBytes, 0, BLOCK_M);
            const uint64 q_desc = n_major_descriptor(s_q(stage) + 2 * consumer * BLOCK_M * kSwizzleRowBytes, 0, BLOCK_M);
            const uint64 ds_mn_desc = n_major_descriptor(s_ds(1), 0, BLOCK_N);
            float dq[2][1][8][4];
            wgmma_fence();
            static_for<BLOCK_M / 16>([&](auto kk_) {
                constexpr int kk = decltype(kk_)::value;
                wgmma_ss<kHalf, BF16, false, true>(flat(acc_dv), descriptor_plus<k_major_offset(kk, BLOCK_N), false>(p_desc),
                                                   descriptor_plus<kk * 16 * kSwizzleRowBytes, false>(do_desc), true);
            });
            wgmma_commit();
            static_for<2>([&](auto chunk_) {
                constexpr int chunk = decltype(chunk_)::value;
                const int block = 2 * consumer + chunk;  // 64-wide column block of K and dQ
                const uint64 kb_desc = n_major_descriptor(s_k + block * BLOCK_N * kSwizzleRowBytes, 0, BLOCK_N);
                static_for<BLOCK_N / 16>([&](auto kk_) {
                    constexpr int kk = decltype(kk_)::value;
                    wgmma_ss<64, BF16, true, true>(flat(dq[chunk]), descriptor_plus<kk * 16 * kSwizzleRowBytes, false>(ds_mn_desc),
                                                   descriptor_plus<kk * 16 * kSwizzleRowBytes, false>(kb_desc), kk > 0);
                });
                wgmma_commit();
            });
            static_for<BLOCK_M / 16>([&](auto kk_) {
                constexpr int kk = decltype(kk_)::value;
                wgmma_ss<kHalf, BF16, false, true>(flat(acc_dk), descriptor_plus<k_major_offset(kk, BLOCK_N), false>(ds_desc),
                                                   descriptor_plus<kk * 16 * kSwizzleRowBytes, false>(q_desc), true);
            });
            wgmma_commit();

            // dQ's chunks added to dq_accum (rows past the sequence's end add nothing), or where the
            // keys are one block stored in dq: the step's dQ is whole.
            float* dq_rows = p.dq_accum + seq.padded_row0(p, batch, head, T::kDQTransposed) * HEADDIM;
            int* counter = nullptr;
            if constexpr (DETERMINISTIC) {  // this key block's turn (named barrier 4: both consumers wait for it)
                counter = dq_turn_counter(p, batch, head, row0 / BLOCK_M);
                if (threadIdx.x == 128) {
                    const int turn = n_block - key_blocks_seen<LOCAL>(p, seq, row0, BLOCK_M, BLOCK_N).first;
                    while (load_acquire(counter) != turn) {}
                }
                consumers_sync(4);
            }
            static_for<2>([&](auto chunk_) {
                constexpr int chunk = decltype(chunk_)::value;
                wgmma_wait<2 - chunk>();  // dV and the chunks up to this one
                fence_operands(flat(dq[chunk]));
                if (stores_dq) {  // 16-byte chunks of whole rows, traded over each quad
                    const int col0 = 64 * (2 * consumer + chunk), row = row0 + lane_row;
                    const int rows_left = seq.seqlen_q - row, cols_left = p.headdim - col0;
                    const int row_stride = int(p.dq_row_stride);  // (as below)
                    uint16* const first = dq_rows_of(p, seq, batch, head) + row * row_stride + col0;
                    for_each_quad_chunk<BF16>(dq[chunk], p.softmax_scale, [&](int half, int col, uint4 value) {
                        st_global_u128_if(8 * half < rows_left && col < cols_left, first + (8 * half * row_stride + col), value);
                    });
                } else {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int row = row0 + lane_row + 8 * half;
                        if (row < seq.seqlen_q) {
#pragma unroll
                            for (int nt = 0; nt < 8; ++nt)
                                atomic_add_pair(dq_rows + dq_accum_index(row, 64 * (2 * consumer + chunk) + fragment_col(nt, 0), HEADDIM),
                                                dq[chunk][0][nt][2 * half], dq[chunk][0][nt][2 * half + 1]);
                        }
                    }
                }
            });
            if constexpr (DETERMINISTIC) {  // every consumer thread's adds are issued before the next block's turn
                consumers_sync(4);
                if (threadIdx.x == 128) add_release(counter, 1);
            }
            wgmma_wait<0>();  // dK: the products are done with Q, dO, P^T and dS^T
            fence_operands(flat(acc_dv));
            fence_operands(flat(acc_dk));
            mbarrier_arrive(q_empty(stage));
            if (consumer == 1 && step + 1 < steps) consumers_arrive(3);
        }

        consumers_sync(5);  // both consumers' products are done with Q and dO, whose buffers take dK and dV
        store_dk_dv<BF16>(p, seq, batch, head_k, key0, kHalf * consumer, acc_dk, acc_dv, s_q(consumer),
                          s_do(consumer));  // its columns
    } else {
        const int wg_key0 = 64 * consumer;                             // this consumer's keys in the block
        const int warp_key0 = key0 + wg_key0 + 16 * (threadIdx.x / 32 % 4);  // this warp's first key
        const bool arrives = threadIdx.x % 32 == 0;  // one arrival per warp on dq_full

        float acc_dk[1][DT][4], acc_dv[1][DT][4];
        zero(acc_dk);
        zero(acc_dv);
        mbarrier_wait(kv_full, 0);

        int head = first_head, row0 = first_row0;
        for (int step = 0; step < steps; ++step, walk.advance(head, row0)) {
            const int stage = step % STAGES, buffer = step % 2;
            if constexpr ((FEATURES & feature::bias) != 0)  // the step's bias reads then wait on L1
                Bias<BF16>(p, seq, batch, recomputed(head), T::kBiasTiles).prefetch<BLOCK_M, 64>(row0, key0 + wg_key0);
            mbarrier_wait(q_full(stage), (step / STAGES) & 1);
            if constexpr (BLOCK_M > Sequence::kPaddedRows) {
                // flash_bwd_dot pads a sequence's rows to a multiple of kPaddedRows (lse_log2 +inf, D
                // 0); the rest of a taller last block is unwritten or the next sequence's, so consumer
                // 0 pads its rows here, before either reads them. Its generic stores are ordered before
                // the producer's next copies into the stage by its fence before q_empty.
                if (row0 + BLOCK_M > seq.seqlen_q) {
                    static_assert(BLOCK_M <= 128, "a consumer thread per row");
                    const int row = threadIdx.x % 128;
                    if (consumer == 0 && row < BLOCK_M && row0 + row >= seq.seqlen_q) {
                        asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(s_lse(stage) + 4 * row), "f"(CUPYFLASH_INF) : "memory");
                        asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(s_dot(stage) + 4 * row), "f"(0.f) : "memory");
                    }
                    consumers_sync(1);
                }
            }

            // S^T = K Q^T and dP^T = V dO^T, two groups: P^T is computed while dP^T runs.
            float s[1][MT][4], dp[1][MT][4];
            wgmma_fence();
            const uint64 k_desc = k_major_descriptor(s_k + wg_key0 * kSwizzleRowBytes, 0, BLOCK_N);
            const uint64 v_desc = k_major_descriptor(s_v + wg_key0 * kSwizzleRowBytes, 0, BLOCK_N);
            const uint64 q_desc = k_major_descriptor(s_q(stage), 0, BLOCK_M);
            const uint64 do_desc = k_major_descriptor(s_do(stage), 0, BLOCK_M);
            static_for<HEADDIM / 16>([&](auto kk_) {
                constexpr int kk = decltype(kk_)::value;
                wgmma_ss<BLOCK_M, BF16>(flat(s), descriptor_plus<k_major_offset(kk, BLOCK_N), false>(k_desc),
                                        descriptor_plus<k_major_offset(kk, BLOCK_M), false>(q_desc), kk > 0);
            });
            wgmma_commit();
            static_for<HEADDIM / 16>([&](auto kk_) {
                constexpr int kk = decltype(kk_)::value;
                wgmma_ss<BLOCK_M, BF16>(flat(dp), descriptor_plus<k_major_offset(kk, BLOCK_N), false>(v_desc),
                                        descriptor_plus<k_major_offset(kk, BLOCK_M), false>(do_desc), kk > 0);
            });
            wgmma_commit();

            // P^T; a column is a query row, whose lse_log2 and D sit in shared memory.
            const float* lse = reinterpret_cast<const float*>(smem_raw + (s_lse(stage) - smem_address(smem_raw)));
            const float* dot = reinterpret_cast<const float*>(smem_raw + (s_dot(stage) - smem_address(smem_raw)));
            const bool masked = block_needs_mask<LOCAL>(p, seq, row0, key0 + wg_key0, BLOCK_M, 64);
            // The step's bias tile, this consumer's 64 keys (0: the bias is read from global memory, or none)
            const uint32 bias_tile = T::kBiasTiles ? s_bias(stage) + consumer * BLOCK_M * kSwizzleRowBytes : 0;
            const int tile_key0 = 16 * (threadIdx.x / 32 % 4);
            // Dropout's decisions (tile nt's at bit 4 nt), drawn while the products run.
            if constexpr (DROPOUT) {
                if (p.dropout_scale != 0.f) {
                    const uint32 bits = step_dropout_bits<BLOCK_M>(p, batch, head, row0, warp_key0);
                    st_shared_u32(s_kept, bits);
                }
            }
            if constexpr (kEarlyProbabilities) {
                wgmma_wait<1>();
                fence_operands(flat(s));
                float no_grad[MT][4];
                for_each_element<1, MT>([&](int, int nt, int e) { no_grad[nt][e] = 1.f; });
                probabilities_transposed<BF16, LOCAL, FEATURES>(s[0], no_grad, 0, p, seq, batch, head, row0, warp_key0,
                                                                masked, lse, bias_tile, tile_key0);
                wgmma_wait<0>();
            } else {
                wgmma_wait<0>();
                fence_operands(flat(s));
            }
            fence_operands(flat(dp));
            // dS^T = P^T (dP^T - D), and both as A fragments (k-slice kk: queries 16 kk .. 16 kk + 15),
            // tile by tile, so that the fp32 fragments are freed as the packed ones fill.
            uint32 p_frag[BLOCK_M / 16][4], ds_frag[BLOCK_M / 16][4];
            uint32 kept = ~0u;  // dropout's decisions: tile nt's at bit 4 nt (all kept where dropout is off)
            if constexpr (DROPOUT) {
                if (p.dropout_scale != 0.f) kept = ld_shared_u32(s_kept);
            }
#pragma unroll
            for (int nt = 0; nt < MT; ++nt) {
                float grad[1][4] = {{1.f, 1.f, 1.f, 1.f}};
                if constexpr (!kEarlyProbabilities)  // the modifiers' d/ds live for one tile only
                    probabilities_transposed<BF16, LOCAL, FEATURES>(s[0], grad, nt, p, seq, batch, head, row0, warp_key0,
                                                                    masked, lse, bias_tile, tile_key0);
                gradients_transposed<BF16, FEATURES>(s[0][nt], dp[0][nt], grad[0], nt, p, seq, batch, head, row0, warp_key0,
                                                     dot, DROPOUT ? kept >> (4 * nt) : 0u);
                p_frag[nt / 2][2 * (nt % 2)] = pack_pair<BF16>(s[0][nt][0], s[0][nt][1]);
                p_frag[nt / 2][2 * (nt % 2) + 1] = pack_pair<BF16>(s[0][nt][2], s[0][nt][3]);
                ds_frag[nt / 2][2 * (nt % 2)] = pack_pair<BF16>(dp[0][nt][0], dp[0][nt][1]);
                ds_frag[nt / 2][2 * (nt % 2) + 1] = pack_pair<BF16>(dp[0][nt][2], dp[0][nt][3]);
            }
            // dS^T to shared memory, keys as rows (its 64 query columns are one swizzled column block);
            // for the transposed dQ, dS with queries as rows (each 8 x 8 piece transposed by stmatrix:
            // lane l names query row l % 8 of piece l / 8, whose 8 keys are one 16-byte chunk).
            if constexpr (T::kDQTransposed) {
                const int lane = threadIdx.x % 32, piece = lane / 8;
                const int piece_key0 = wg_key0 + 16 * (threadIdx.x / 32 % 4) + 8 * (piece % 2);
#pragma unroll
                for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
                    const int query = 16 * kk + 8 * (piece / 2) + lane % 8;
                    stmatrix_x4_trans(s_ds(buffer) + swizzled_offset(query, piece_key0, BLOCK_M), ds_frag[kk][0], ds_frag[kk][1],
                                      ds_frag[kk][2], ds_frag[kk][3]);
                }
            } else {
                // swizzled_offset(row + 8 half, fragment_col(nt, 0), BLOCK_N) as one XOR of the thread's
                // first address, whose bits 4-6 hold the swizzle's row % 8 (the tile is 1024-byte
                // aligned), and a constant: the 64-column block and the half.
                const int row = wg_key0 + 16 * (threadIdx.x / 32 % 4) + (threadIdx.x % 32) / 4;
                const uint32 first = s_ds(buffer) + row * kSwizzleRowBytes + 16 * (row % 8) + 4 * (threadIdx.x % 4);
                static_for<MT>([&](auto nt_) {
                    static_for<2>([&](auto half_) {
                        constexpr int nt = decltype(nt_)::value, half = decltype(half_)::value;
                        st_shared_u32<(nt / 8) * BLOCK_N * kSwizzleRowBytes + 8 * half * kSwizzleRowBytes>(
                            first ^ (16 * (nt % 8)), ds_frag[nt / 2][2 * (nt % 2) + half]);
                    });
                });
            }
            fence_proxy_async();  // dS^T's stores, then wgmma reads them

            // dV += P^T dO, then dQ = dS K, then dK += dS^T Q, three groups: dQ is stored while dK
            // runs (its product's latency and its store then overlap the tensor cores' work).
            // dV and dK: B N-major (the rows of dO and Q are the k dimension here).
            wgmma_fence();
            const uint64 do_n_desc = n_major_descriptor(s_do(stage), 0, BLOCK_M);
            const uint64 q_n_desc = n_major_descriptor(s_q(stage), 0, BLOCK_M);
            static_for<BLOCK_M / 16>([&](auto kk_) {
                constexpr int kk = decltype(kk_)::value;
                wgmma_rs<HEADDIM, BF16>(flat(acc_dv), p_frag[kk], descriptor_plus<kk * 16 * kSwizzleRowBytes, false>(do_n_desc), true);
            });
            wgmma_commit();

            // dQ: A is dS^T's tile read MN-major (split rows: this consumer's column block of it), B
            // the K tile read N-major (split columns: this consumer's column block of it).
            float dq[1][T::kDQTransposed ? BLOCK_M / 8 : kDQWidth / 8][4];  // (transposed: dQ^T's)
            constexpr bool kAllKeys = T::kSplitDQColumns || T::kSplitDQRows;
            constexpr int kDQKeys = kAllKeys ? BLOCK_N : 64;
            const uint32 ds_tile = s_ds(buffer) + (T::kSplitDQRows ? consumer * BLOCK_N * kSwizzleRowBytes
                                                   : kAllKeys ? 0 : wg_key0 * kSwizzleRowBytes);
            const uint32 k_tile = s_k + (T::kSplitDQColumns ? consumer * BLOCK_N * kSwizzleRowBytes
                                         : kAllKeys ? 0 : wg_key0 * kSwizzleRowBytes);
            // Every warp's dS^T rows are stored before the product reads them: both consumers' (named
            // barrier 1), or this one's (barrier 2 + consumer).
            if constexpr (kAllKeys) consumers_sync(1);
            else warpgroup_sync(2 + consumer);
            wgmma_fence();
            const uint64 kb_desc = n_major_descriptor(k_tile, 0, BLOCK_N);
            if constexpr (T::kDQTransposed) {  // dQ^T = K^T dS^T: A the K tile's column block MN-major, B dS K-major
                const uint64 dst_desc = k_major_descriptor(s_ds(buffer), 0, BLOCK_M);
                static_for<BLOCK_N / 16>([&](auto kk_) {
                    constexpr int kk = decltype(kk_)::value;
                    wgmma_ss<BLOCK_M, BF16, true, false>(flat(dq), descriptor_plus<kk * 16 * kSwizzleRowBytes, false>(kb_desc),
                                                         descriptor_plus<k_major_offset(kk, BLOCK_M), false>(dst_desc), kk > 0);
                });
            } else {
                const uint64 ds_desc = n_major_descriptor(ds_tile, 0, BLOCK_N);
                static_for<kDQKeys / 16>([&](auto kk_) {
                    constexpr int kk = decltype(kk_)::value;
                    wgmma_ss<kDQWidth, BF16, true, true>(flat(dq), descriptor_plus<kk * 16 * kSwizzleRowBytes, false>(ds_desc),
                                                         descriptor_plus<kk * 16 * kSwizzleRowBytes, false>(kb_desc), kk > 0);
                });
            }
            wgmma_commit();
            static_for<BLOCK_M / 16>([&](auto kk_) {
                constexpr int kk = decltype(kk_)::value;
                wgmma_rs<HEADDIM, BF16>(flat(acc_dk), ds_frag[kk], descriptor_plus<kk * 16 * kSwizzleRowBytes, false>(q_n_desc), true);
            });
            wgmma_commit();
            wgmma_wait<1>();  // dV and dQ are done
            fence_operands(flat(acc_dv));
            fence_operands(flat(dq));

            if (stores_dq) {  // the step's whole dQ (the keys are one block), scaled, into dq: whole rows
                if constexpr (T::kCanStoreDQ) {  // through this warpgroup's 64 rows of s_dq (idle: no adder)
                    constexpr int kTiles = kDQWidth / 8;
                    static_assert(2 * 64 * 16 * kTiles <= T::kDQBytes, "both consumers' staged rows fit dQ's buffer");
                    const uint32 stage = s_dq + consumer * 64 * 16 * kTiles;
                    // (The parameters in locals: each asm store would reload them. The row stride of the
                    // plan's dq is nheads x headdim: an int, which spares 64-bit products.)
                    const int stage_row0 = row0 + (T::kSplitDQRows ? 64 * consumer : 0);
                    const int col0 = T::kSplitDQColumns ? consumer * kDQWidth : 0;
                    const int rows_left = seq.seqlen_q - stage_row0, cols_left = p.headdim - col0;
                    const int row_stride = int(p.dq_row_stride);
                    uint16* rows = dq_rows_of(p, seq, batch, head) + stage_row0 * row_stride + col0;
                    asm("" : "+l"(rows));  // (opaque: else each store recomputes it, ~15 instructions)
                    __syncwarp();  // (the warp's lanes are done reading the last step's rows)
                    stage_rows<BF16>(stage, dq, p.softmax_scale);
                    __syncwarp();
                    for_each_staged_chunk<kTiles, true>([&](int row, int chunk, uint32 offset) {
                        const uint4 value = ld_shared_u128(stage + offset);
                        st_global_u128_if(row < rows_left && 8 * chunk < cols_left, rows + (row * row_stride + 8 * chunk), value);
                    });
                }
            } else {
                // dQ into shared memory in dq_accum's layout (dq_accum_index: each warp's pair stores fill
                // 256 contiguous bytes; the transposed kernel's: dq_accum_fragment_index, each thread's
                // four floats of a tile 16 contiguous bytes), once the adder has read the last step's.
                if (step > 0) mbarrier_wait(dq_empty, (step - 1) & 1);
                // Each address is the thread's first plus a constant (dq_accum_index(r + 8 i, c + 8 j, W) is
                // dq_accum_index(r, c, W) + 8 i W + 64 j), written into the instruction: built by the
                // compiler, the addresses took ~90 instructions a step at hd128.
                if constexpr (T::kDQTransposed) {  // a tile's four floats, the warpgroup's threads side by side
                    const uint32 first = s_dq + 16 * uint32(consumer * (BLOCK_M / 8) * 128 + threadIdx.x % 128);
                    static_for<BLOCK_M / 8>([&](auto nt_) {
                        constexpr int nt = decltype(nt_)::value;
                        asm volatile("st.shared.v4.f32 [%0+%5], {%1, %2, %3, %4};\n" :: "r"(first), "f"(dq[0][nt][0]),
                                     "f"(dq[0][nt][1]), "f"(dq[0][nt][2]), "f"(dq[0][nt][3]), "n"(16 * 128 * nt) : "memory");
                    });
                } else {
                    const int q_row = (T::kSplitDQRows ? 64 * consumer : 0) + 16 * (threadIdx.x / 32 % 4) + (threadIdx.x % 32) / 4;
                    const int col0 = (T::kSplitDQColumns ? consumer * kDQWidth : 0) + fragment_col(0, 0);
                    const uint32 piece = s_dq + (T::kDQPieces == 1 ? 0 : consumer * T::kDQBytes);
                    const uint32 first = piece + 4 * uint32(dq_accum_index(q_row, col0, HEADDIM));
                    static_for<2>([&](auto half_) {
                        static_for<kDQWidth / 8>([&](auto nt_) {
                            constexpr int half = decltype(half_)::value, nt = decltype(nt_)::value;
                            asm volatile("st.shared.v2.f32 [%0+%3], {%1, %2};\n" :: "r"(first), "f"(dq[0][nt][2 * half]),
                                         "f"(dq[0][nt][2 * half + 1]), "n"(4 * (8 * half * HEADDIM + 64 * nt)) : "memory");
                        });
                    });
                }
                fence_proxy_async();  // the stores, then the copy engine reads them
                __syncwarp();
                if (arrives) mbarrier_arrive(dq_full);
            }
            wgmma_wait<0>();  // dK is done with Q (and dV with dO)
            fence_operands(flat(acc_dk));
            mbarrier_arrive(q_empty(stage));
        }

        consumers_sync(5);  // both consumers' products are done with Q and dO, whose buffers take dK and dV
        store_dk_dv<BF16>(p, seq, batch, head_k, key0 + wg_key0, 0, acc_dk, acc_dv, s_q(consumer), s_do(consumer));
    }
}
