// Forward pass: out = softmax(q k^T * scale) v, and lse = logsumexp(q k^T * scale) per row.
//
// One CTA per (query block, head, batch). Each warp owns BLOCK_M / WARPS whole query rows, so
// the online softmax needs only shuffles inside a quad. Per key block (walked from the last to
// the first, so the masked blocks come first):
//   S = Q K(n)^T (tensor cores) -> mask if the block needs it -> online softmax in base 2
//   -> O += P V(n), where P stays in registers: the fp32 S fragment, packed to 16 bits, is
//   exactly the A fragment of P V.
// Loads: with one stage, V(n) is loaded while S is computed and K(n-1) while P V(n) is (two
// barriers per block); with two stages, K(n-1) and V(n-1) are loaded into the other buffer
// while all of block n is computed (one barrier per block, twice the K/V shared memory).
// LOCAL kernels bound each row's keys (causal, sliding window); FEATURES adds the score options of
// common/score.cuh that a call uses (softcap, ALiBi, attn_bias, dropout; OPTIONS: any of them).
// Varlen is a run-time property.
#pragma once
#include "../common/mask.cuh"
#include "../common/math.cuh"
#include "../common/online_softmax.cuh"
#include "../common/score.cuh"
#include "tile.cuh"

template <int HEADDIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES>
struct FwdTile {
    static constexpr int kThreads = WARPS * 32;
    static constexpr int kWarpRows = BLOCK_M / WARPS;
    static constexpr int MT = kWarpRows / 16;        // m16 tiles per warp
    static constexpr int NT = BLOCK_N / 8;           // n8 tiles of S
    static constexpr int DT = HEADDIM / 8;           // n8 tiles of O
    static constexpr int kSmemBytes = TileLayout<HEADDIM>::template bytes<BLOCK_M + 2 * BLOCK_N * STAGES>();  // Q, (K, V) x stages
    static_assert(kWarpRows % 16 == 0, "each warp owns a multiple of 16 query rows");
    static_assert(BLOCK_N % 16 == 0 && HEADDIM % 16 == 0, "tiles are built of 16-wide mma steps");
    static_assert(STAGES == 1 || STAGES == 2, "K and V have one or two buffers");
};

template <int HEADDIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES, bool BF16, bool LOCAL, bool EVEN_K,
          int FEATURES>
__device__ __forceinline__ void flash_fwd(const FlashParams& p) {
    typedef FwdTile<HEADDIM, BLOCK_M, BLOCK_N, WARPS, STAGES> T;
    constexpr bool OPTIONS = FEATURES != 0, DROPOUT = (FEATURES & feature::dropout) != 0;
    constexpr int MT = T::MT, NT = T::NT, DT = T::DT;
    // A 16-bit bias read as words (common/score.cuh, added_as_words) holds 2 MT NT registers more:
    // beside an O accumulator of 128 registers (hd128 x 32 rows, hd256 x 16) that spills.
    constexpr bool kBiasWords = MT * DT * 4 < 128;
    // Every thread is active in the tile copies, without a test (not at hd256, whose LOCAL
    // kernels spill with it).
    if constexpr (HEADDIM != 256) __builtin_assume(threadIdx.x < T::kThreads);
    constexpr int kStride = TileLayout<HEADDIM>::kStride;

    extern __shared__ __align__(128) uint16 smem[];
    uint16* s_q = smem;
    // Block n's K tile, followed by its V tile.
    auto s_k = [&](int n_block) { return smem + (BLOCK_M + (STAGES == 1 ? 0 : n_block & 1) * 2 * BLOCK_N) * kStride; };

    // The last query blocks first: with a causal mask they see the most keys (grid_slot).
    const GridSlot slot = grid_slot<LOCAL>(p);
    const int m_block = slot.blocks - 1 - slot.block, head = slot.head, batch = slot.batch;
    const int head_k = head / (p.nheads / p.nheads_k);
    const int row0 = m_block * BLOCK_M;
    const int warp_row0 = (threadIdx.x / 32) * T::kWarpRows;
    const Sequence seq(p, batch);
    if (row0 >= seq.seqlen_q) return;  // a varlen grid covers the longest sequence

    const uint16* q = static_cast<const uint16*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride
                      + (seq.first_row_q + row0) * p.q_row_stride;
    const uint16* k = static_cast<const uint16*>(p.k) + batch * p.k_batch_stride + head_k * p.k_head_stride
                      + seq.first_row_k * p.k_row_stride;
    const uint16* v = static_cast<const uint16*>(p.v) + batch * p.v_batch_stride + head_k * p.v_head_stride
                      + seq.first_row_k * p.v_row_stride;

    float acc_o[MT][DT][4];
    zero(acc_o);
    float row_max[MT][2], row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) { row_max[mt][half] = -CUPYFLASH_INF; row_sum[mt][half] = 0.f; }

    const BlockRange blocks = key_blocks_seen<LOCAL>(p, seq, row0, BLOCK_M, BLOCK_N);
    // Under a causal mask or a window a warp's own rows may see none of a masked block's keys (on
    // the diagonal of a 128x32 tile, 6 of its 16 warp-blocks): the warp skips that block's math
    // (in the plain kernels' masked loop), still taking part in its loads and barriers.
    const BlockRange warp_blocks = key_blocks_seen<LOCAL>(p, seq, row0 + warp_row0, T::kWarpRows, BLOCK_N);
    if (blocks.end > blocks.first) {
        const int key0 = (blocks.end - 1) * BLOCK_N;
        copy_tile_async<BLOCK_M, HEADDIM, T::kThreads, !EVEN_K>(s_q, q, p.q_row_stride, seq.seqlen_q - row0,
                                                                p.headdim);
        copy_tile_async<BLOCK_N, HEADDIM, T::kThreads, !EVEN_K>(s_k(blocks.end - 1), k + key0 * p.k_row_stride,
                                                                p.k_row_stride, seq.seqlen_k - key0, p.headdim);
        if constexpr (STAGES == 2)
            copy_tile_async<BLOCK_N, HEADDIM, T::kThreads, !EVEN_K>(s_k(blocks.end - 1) + BLOCK_N * kStride,
                                                                    v + key0 * p.v_row_stride, p.v_row_stride,
                                                                    seq.seqlen_k - key0, p.headdim);
        cp_async_commit();
    }
    const ScoreMods<BF16, FEATURES> mods(p, seq, batch, head);  // OPTIONS only; dead code otherwise
    const float bound = score_bound<FEATURES, BF16>(p);

    auto needs_mask = [&](int n_block) {
        return block_needs_mask<LOCAL>(p, seq, row0, n_block * BLOCK_N, BLOCK_M, BLOCK_N);
    };
    // One key block, masked per element always (kAll), never (kNone), or where needs_mask says
    // (kPerBlock). Only the sequence's last block can be partial, and only a block that may be
    // masked has its loads bounded.
    enum Masking { kAll, kNone, kPerBlock };
    auto attend = [&](int n_block, auto masking) {
        constexpr Masking MASKING = decltype(masking)::value;
        const bool masked = MASKING == kAll || (MASKING == kPerBlock && needs_mask(n_block));
        const int key0 = n_block * BLOCK_N;
        uint16* s_k_n = s_k(n_block);
        uint16* s_v_n = s_k_n + BLOCK_N * kStride;
        auto load_next_k = [&](uint16* tile) {  // K(n-1) (whole: only the last block is partial)
            copy_tile_async<BLOCK_N, HEADDIM, T::kThreads, !EVEN_K, false>(tile, k + (key0 - BLOCK_N) * p.k_row_stride,
                                                                           p.k_row_stride, BLOCK_N, p.headdim);
        };
        cp_async_wait<0>();
        __syncthreads();  // K(n) has landed (two stages: and V(n)); every warp is done with block n+1
        if constexpr (STAGES == 1) {
            copy_tile_async<BLOCK_N, HEADDIM, T::kThreads, !EVEN_K, MASKING != kNone>(
                s_v_n, v + key0 * p.v_row_stride, p.v_row_stride, seq.seqlen_k - key0, p.headdim);
            cp_async_commit();
        } else if (n_block > blocks.first) {
            uint16* s_k_next = s_k(n_block - 1);
            load_next_k(s_k_next);
            copy_tile_async<BLOCK_N, HEADDIM, T::kThreads, !EVEN_K, false>(
                s_k_next + BLOCK_N * kStride, v + (key0 - BLOCK_N) * p.v_row_stride, p.v_row_stride, BLOCK_N, p.headdim);
            cp_async_commit();
        }

        const bool warp_skips = LOCAL && MASKING == kAll && (n_block < warp_blocks.first || n_block >= warp_blocks.end);
        float s[MT][NT][4];
        typename RowShiftFor<MT, (FEATURES & feature::alibi) != 0>::type shift = {};
        if (!warp_skips) {
            zero(s);
            warp_gemm<BF16, MT, NT, HEADDIM, HEADDIM, true, HEADDIM, true>(s, s_q, warp_row0, s_k_n, 0);
            // (A bias read as words is loaded here, not before the product: held across it, the
            // words spill at hd64 and hd256; other warps cover the loads' latency.)
            if constexpr (OPTIONS) apply_score_mods<kBiasWords>(s, mods, row0 + warp_row0, key0, shift);
            if (masked) mask_fragment<LOCAL>(s, p, seq, row0 + warp_row0, key0, -CUPYFLASH_INF);
        }

        if constexpr (STAGES == 1) {
            cp_async_wait<0>();
            __syncthreads();  // V(n) has landed; every warp is done with K(n)
            if (n_block > blocks.first) {
                load_next_k(s_k_n);
                cp_async_commit();
            }
        }
        if (warp_skips) return;

        softmax_step(s, acc_o, row_max, row_sum, p, score_unit<FEATURES>(p), shift, bound);

        uint32 p_frag[BLOCK_N / 16][MT][4];
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                p_frag[kk][mt][0] = pack_pair<BF16>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                p_frag[kk][mt][1] = pack_pair<BF16>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                p_frag[kk][mt][2] = pack_pair<BF16>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                p_frag[kk][mt][3] = pack_pair<BF16>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
        // Dropout acts on the probabilities after the softmax: the sums above keep every element,
        // P V only the kept ones (scaled by p.dropout_scale at the end).
        if (DROPOUT && p.dropout_scale != 0.f)
            apply_dropout_packed<MT, NT>([&](int mt, int kk, int r) -> uint32& { return p_frag[kk][mt][r]; }, p,
                                         batch, head, row0 + warp_row0, key0);
        // (V's swizzled addresses are XORed after the step's offset at hd128 LOCAL: XORed bases
        // kept in registers make those kernels spill.)
        warp_gemm_a_in_registers<BF16, MT, DT, BLOCK_N, HEADDIM, false, LOCAL && HEADDIM == 128>(acc_o, p_frag, s_v_n, 0);
    };
    // The blocks that need a mask come in two runs: at the end of the range (the sequence's last,
    // those on the diagonal) and, with a window, at its start. They run in their own loop, so
    // that the main loop has no mask code. The options' kernels keep one loop, masked where needed:
    // a second copy of their longer body costs more registers than the mask-free loop saves.
    int n_block = blocks.end - 1;
    if constexpr (OPTIONS) {
        for (; n_block >= blocks.first; --n_block) attend(n_block, Constant<kPerBlock>());
    } else {
        // The masked blocks after the unmasked ones, those, then (a window's left edge) the masked
        // ones before them: one copy of each loop body, and bounds computed once, so each loop
        // tests only n_block. (A needs_mask test per block, with the copies' activity test that
        // the assume above removes, makes the causal cells at 4k-16k 3-5% slower.)
        const BlockRange unmasked = key_blocks_unmasked<LOCAL>(p, seq, row0, BLOCK_M, BLOCK_N, blocks);
        int masked_first = unmasked.end;
#pragma unroll 1
        for (int turn = 0; turn < (LOCAL ? 2 : 1); ++turn) {
            for (; n_block >= masked_first; --n_block) attend(n_block, Constant<kAll>());
            if (turn == 0)
                for (; n_block >= unmasked.first; --n_block) attend(n_block, Constant<kNone>());
            masked_first = blocks.first;
        }
    }

    // A row that saw no key gets out = 0 and lse = -inf (the log of an empty sum).
    const float out_scale = DROPOUT && p.dropout_scale != 0.f ? p.dropout_scale : 1.f;
    finish_rows(acc_o, row_max, row_sum, out_scale, p, score_unit<FEATURES>(p), p.lse + seq.stats_row0(p, batch, head),
                row0 + warp_row0, seq.seqlen_q);

    // O leaves through shared memory (the Q tile, no longer needed) for 16-byte coalesced stores.
    cp_async_wait<0>();
    __syncthreads();
    store_fragment<BF16, MT, DT, HEADDIM>(s_q, acc_o, 1.f, warp_row0, 0);
    __syncthreads();
    uint16* out = static_cast<uint16*>(p.out) + batch * p.out_batch_stride + head * p.out_head_stride
                  + (seq.first_row_q + row0) * p.out_row_stride;
    store_tile<BLOCK_M, HEADDIM, T::kThreads, !EVEN_K>(out, s_q, p.out_row_stride, seq.seqlen_q - row0, p.headdim);
}
