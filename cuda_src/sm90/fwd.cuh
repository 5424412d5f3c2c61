// Forward pass on Hopper (sm_90a): what sm80/fwd.cuh computes, on wgmma and TMA.
//
// One CTA per (query block of 128 rows, head, batch), three warpgroups. The first is the
// producer: one thread issues the TMA copies of Q (once) and of each key block's K and V into a
// ring of STAGES buffers. The other two are consumers, each owning 64 query rows; per key block
// (from the last to the first, as sm80) a consumer computes
//   S = Q K^T (wgmma, both from shared memory) -> options, mask -> online softmax
//   -> O += P V (wgmma, P from registers, V read N-major),
// with the fragment steps of common/online_softmax.cuh (a warpgroup's accumulator is mma.sync's
// fragment per warp). Barriers: q_full, and per stage k_full and v_full (the copies' bytes have
// landed) and empty (each consumer warp arrives when done with the stage's K and V).
// Tiles sit in the 128-byte swizzle of sm90/wgmma.cuh, as TMA writes them: 64-wide column blocks.
#pragma once
#include "../common/online_softmax.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

// Tensor maps of q, k and v, 4-D (head dim, rows, heads, batch): boxes of 64 columns by a tile's
// rows. A varlen call's maps have batch 1 and the packed rows.
struct FwdMaps {
    TensorMap q, k, v;
};

template <int HEADDIM, int BLOCK_N, int STAGES>
struct Sm90FwdTile {
    static constexpr int kBlockM = 128;                    // two consumer warpgroups of 64 rows
    static constexpr int kThreads = 384;
    static constexpr int kQBytes = kBlockM * HEADDIM * 2;
    static constexpr int kKVBytes = BLOCK_N * HEADDIM * 2;  // one K or V buffer
    static constexpr int kBarrierBytes = 8 * (1 + 3 * STAGES);
    // The dynamic shared memory's start is aligned up to 1024 bytes (the swizzle's atom) in the kernel.
    static constexpr int kSmemBytes = 1024 + kQBytes + 2 * STAGES * kKVBytes + kBarrierBytes;
    static_assert(HEADDIM % 64 == 0 && HEADDIM <= 256, "tiles are whole 64-wide column blocks");
    static_assert(BLOCK_N == 64 || BLOCK_N == 128, "S is one wgmma wide");
};

template <int HEADDIM, int BLOCK_N, int STAGES, bool BF16, bool LOCAL, bool OPTIONS>
__device__ __forceinline__ void flash_fwd_sm90(const FlashParams& p, const FwdMaps& maps) {
    typedef Sm90FwdTile<HEADDIM, BLOCK_N, STAGES> T;
    constexpr int BLOCK_M = T::kBlockM, NT = BLOCK_N / 8, DT = HEADDIM / 8;
    constexpr int kOWidth = HEADDIM == 64 ? 64 : 128;  // columns of O per P V wgmma

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32 s_q = (smem_address(smem_raw) + 1023) & ~1023u;
    auto s_k = [&](int stage) { return s_q + T::kQBytes + stage * 2 * T::kKVBytes; };
    auto s_v = [&](int stage) { return s_k(stage) + T::kKVBytes; };
    const uint32 q_full = s_q + T::kQBytes + 2 * STAGES * T::kKVBytes;
    auto k_full = [&](int stage) { return q_full + 8 * (1 + stage); };
    auto v_full = [&](int stage) { return q_full + 8 * (1 + STAGES + stage); };
    auto empty = [&](int stage) { return q_full + 8 * (1 + 2 * STAGES + stage); };

    const GridSlot slot = grid_slot<LOCAL>(p);
    const int m_block = slot.blocks - 1 - slot.block, head = slot.head, batch = slot.batch;
    const int head_k = head / (p.nheads / p.nheads_k);
    const int row0 = m_block * BLOCK_M;
    const Sequence seq(p, batch);
    if (row0 >= seq.seqlen_q) return;  // a varlen grid covers the longest sequence
    const BlockRange blocks = key_blocks_seen<LOCAL>(p, seq, row0, BLOCK_M, BLOCK_N);
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        mbarrier_init(q_full, 1);
#pragma unroll
        for (int stage = 0; stage < STAGES; ++stage) {
            mbarrier_init(k_full(stage), 1);
            mbarrier_init(v_full(stage), 1);
            mbarrier_init(empty(stage), 8);  // the consumers' warps
        }
        fence_mbarrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0 && blocks.end > blocks.first) {
            const int batch_coord = p.cu_seqlens_q == nullptr ? batch : 0;
            mbarrier_arrive_expect_tx(q_full, T::kQBytes);
#pragma unroll
            for (int cb = 0; cb < HEADDIM / 64; ++cb)
                tma_load_4d(s_q + cb * BLOCK_M * kSwizzleRowBytes, &maps.q, q_full, 64 * cb, seq.first_row_q + row0,
                            head, batch_coord);
            int i = 0;
            for (int n_block = blocks.end - 1; n_block >= blocks.first; --n_block, ++i) {
                const int stage = i % STAGES;
                if (i >= STAGES) mbarrier_wait(empty(stage), ((i / STAGES) & 1) ^ 1);
                const int key_row = seq.first_row_k + n_block * BLOCK_N;
                mbarrier_arrive_expect_tx(k_full(stage), T::kKVBytes);
#pragma unroll
                for (int cb = 0; cb < HEADDIM / 64; ++cb)
                    tma_load_4d(s_k(stage) + cb * BLOCK_N * kSwizzleRowBytes, &maps.k, k_full(stage), 64 * cb, key_row,
                                head_k, batch_coord);
                mbarrier_arrive_expect_tx(v_full(stage), T::kKVBytes);
#pragma unroll
                for (int cb = 0; cb < HEADDIM / 64; ++cb)
                    tma_load_4d(s_v(stage) + cb * BLOCK_N * kSwizzleRowBytes, &maps.v, v_full(stage), 64 * cb, key_row,
                                head_k, batch_coord);
            }
        }
        return;
    }

    setmaxnreg_inc<240>();
    const int wg_row0 = (warpgroup - 1) * 64;  // this warpgroup's rows in the tile
    const int warp_row0 = wg_row0 + 16 * (threadIdx.x / 32 % 4);
    // A masked block none of whose keys the warpgroup's rows see is skipped (its buffers released).
    const BlockRange wg_blocks = key_blocks_seen<LOCAL>(p, seq, row0 + wg_row0, 64, BLOCK_N);

    float acc_o[1][DT][4];
    zero(acc_o);
    float row_max[1][2] = {{-CUPYFLASH_INF, -CUPYFLASH_INF}}, row_sum[1][2] = {{0.f, 0.f}};
    const ScoreMods<BF16> mods(p, seq, batch, head);  // OPTIONS only; dead code otherwise
    if (blocks.end > blocks.first) mbarrier_wait(q_full, 0);

    int i = 0;  // the ring's step, as the producer counts it
    enum Masking { kAll, kNone, kPerBlock };
    auto attend = [&](int n_block, auto masking) {
        constexpr Masking MASKING = decltype(masking)::value;
        const int stage = i % STAGES, phase = (i / STAGES) & 1;
        ++i;
        const int key0 = n_block * BLOCK_N;
        const bool skips = LOCAL && MASKING != kNone && (n_block < wg_blocks.first || n_block >= wg_blocks.end);
        if (!skips) {
            const bool masked = MASKING == kAll
                                || (MASKING == kPerBlock
                                    && block_needs_mask<LOCAL>(p, seq, row0 + wg_row0, key0, 64, BLOCK_N));
            float s[1][NT][4];
            mbarrier_wait(k_full(stage), phase);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < HEADDIM / 16; ++kk)
                wgmma_ss<BLOCK_N, BF16>(reinterpret_cast<float(&)[BLOCK_N / 2]>(s),
                                        k_major_descriptor(s_q + wg_row0 * kSwizzleRowBytes, kk, BLOCK_M),
                                        k_major_descriptor(s_k(stage), kk, BLOCK_N), kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            if constexpr (OPTIONS) apply_score_mods(s, mods, row0 + warp_row0, key0);
            if (masked) mask_fragment<LOCAL>(s, p, seq, row0 + warp_row0, key0, -CUPYFLASH_INF);
            softmax_step(s, acc_o, row_max, row_sum, p);
            // Dropout acts on the probabilities after the softmax: the sums keep every element.
            if constexpr (OPTIONS) {
                if (p.dropout_scale != 0.f) apply_dropout(s, p, batch, head, row0 + warp_row0, key0);
            }
            uint32 p_frag[BLOCK_N / 16][4];
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                p_frag[kk][0] = pack_pair<BF16>(s[0][2 * kk][0], s[0][2 * kk][1]);
                p_frag[kk][1] = pack_pair<BF16>(s[0][2 * kk][2], s[0][2 * kk][3]);
                p_frag[kk][2] = pack_pair<BF16>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
                p_frag[kk][3] = pack_pair<BF16>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
            }
            mbarrier_wait(v_full(stage), phase);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
                for (int part = 0; part < HEADDIM / kOWidth; ++part)
                    wgmma_rs<kOWidth, BF16>(reinterpret_cast<float(&)[kOWidth / 2]>(acc_o[0][part * kOWidth / 8]), p_frag[kk],
                                            n_major_descriptor(s_v(stage) + part * (kOWidth / 64) * BLOCK_N * kSwizzleRowBytes,
                                                               kk, BLOCK_N),
                                            true);
            wgmma_commit();
            wgmma_wait<0>();
        }
        __syncwarp();
        if (threadIdx.x % 32 == 0) mbarrier_arrive(empty(stage));
    };
    // As sm80: the masked blocks at the end of the range, the unmasked ones, then a window's
    // masked ones at its start, so the main loop has no mask code; the options' kernels one loop.
    int n_block = blocks.end - 1;
    if constexpr (OPTIONS) {
        for (; n_block >= blocks.first; --n_block) attend(n_block, Constant<kPerBlock>());
    } else {
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

    const float out_scale = OPTIONS && p.dropout_scale != 0.f ? p.dropout_scale : 1.f;
    finish_rows(acc_o, row_max, row_sum, out_scale, p, p.lse + seq.stats_row0(p, batch, head), row0 + warp_row0,
                seq.seqlen_q);
    uint16* out = static_cast<uint16*>(p.out) + batch * p.out_batch_stride + head * p.out_head_stride
                  + seq.first_row_q * p.out_row_stride;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = row0 + warp_row0 + fragment_row(0, 2 * half);
        if (row < seq.seqlen_q)
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int col = fragment_col(dt, 0);
                if (col < p.headdim)
                    *reinterpret_cast<uint32*>(out + row * p.out_row_stride + col) =
                        pack_pair<BF16>(acc_o[0][dt][2 * half], acc_o[0][dt][2 * half + 1]);
            }
    }
}
