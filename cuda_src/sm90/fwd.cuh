// Forward pass on Hopper (sm_90a): what sm80/fwd.cuh computes, on wgmma and TMA.
//
// Persistent: one CTA per SM takes tiles (query block of 64 CONSUMERS rows, head, batch), those
// that see the most keys first (fwd_tile): in rounds, or in the LOCAL kernels, whose tiles differ
// in weight, as each CTA finishes one (next_tile). The first warpgroup is the producer: one
// thread issues the TMA copies of each tile's Q and of its key blocks' K and V into a ring of
// STAGES buffers, running ahead into the next tile while the consumers finish one. The others
// (two, or three at hd64) are consumers, each owning 64 query rows; per key block (from the last
// to the first, as sm80) a consumer computes
//   S = Q K^T (wgmma, both from shared memory) -> options, mask -> online softmax
//   -> O += P V (wgmma, P from registers, V read N-major),
// with the fragment steps of common/online_softmax.cuh (a warpgroup's accumulator is mma.sync's
// fragment per warp). The products run asynchronously: block n's S = Q K^T is issued together
// with the previous block's O += P V, and block n's softmax runs while that P V does; O is
// rescaled after it. Below hd256 the consumers also take turns to issue (ping-pong), so one's
// softmax overlaps the others' products. Kernels with two Q buffers run tiles back to back: a
// tile's last P V is issued with the next tile's first Q K^T (kCarry). Barriers: per Q
// buffer q_full and q_empty (the consumers' last S = Q K^T of a tile has read Q), and per stage
// k_full and v_full (the copies' bytes have landed) and k_empty and v_empty (each consumer warp
// arrives when its products have read them).
// Tiles sit in the 128-byte swizzle of sm90/wgmma.cuh, as TMA writes them: 64-wide column blocks.
#pragma once
#include "../common/online_softmax.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

// Tensor maps of q, k and v, 4-D (head dim, rows, heads, batch): boxes of 64 columns by a tile's
// rows. A varlen call's maps have batch 1 and the packed rows. `bias`, where the kernel has bias tiles:
// the attn_bias's (keys, rows, heads, batch), boxes of 64 keys by a tile's rows (one row where the
// bias is broadcast over them), a broadcast dimension of size 1.
struct FwdMaps {
    TensorMap q, k, v, bias;
};

// ALiBi's column terms by the tensor cores. Where a warpgroup's 64 rows see all of a block's keys
// on one side of their diagonals, ALiBi is k (col - diagonal(row)) (alibi_by_columns in
// common/score.cuh): k (key0 - diagonal(row)), a row term the softmax adds (AlibiAddedShift), plus
// k n for the key's column n in the block, which joins S = Q K^T as one more 16-deep product: A
// (registers, the same in every row) holds k as three 16-bit pieces in columns 0-2, whose sum is k
// to fp32's precision, and zeros; B (a constant tile) holds n in its rows 0-2. An element then
// costs no instruction, where alibi_by_columns costs an FFMA. Blocks across the diagonals get
// A = 0 and ALiBi per element.
struct AlibiProducts {
    // B stored N-major, unswizzled: wgmma's core matrices of 8 rows (k) by 8 keys (16 bytes), the
    // rows 16 bytes apart, here 48 bytes (three rows) from one 8 keys to the next, for both
    // descriptor offsets: what a core matrix reads past its third row (or of rows 8-15) is the next
    // keys' or, after the last, zeros, which A's zeros multiply.
    static constexpr int kTileBytes = 16 * 48 + 128;
    uint32 word;  // this lane's A word for k: rows g and g + 8, columns 2t and 2t + 1

    // Thread `thread` (< kTileBytes / 16) writes its 16 bytes of B.
    template <bool BF16>
    static __device__ __forceinline__ void write_tile(uint32 tile, int thread) {
        const int keys = thread / 3;  // (the 8 keys' core matrix, row thread % 3)
#pragma unroll
        for (int pair = 0; pair < 4; ++pair) {
            const float n = 8.f * keys + 2 * pair;
            st_shared_u32(tile + 16 * thread + 4 * pair, keys < 16 ? pack_pair<BF16>(n, n + 1.f) : 0u);
        }
    }
    static __device__ __forceinline__ uint64 descriptor(uint32 tile) { return smem_descriptor(tile, 48, 48, 0); }

    // Whether fp16 holds k (bfloat16 has float's range).
    template <bool BF16>
    static __device__ __forceinline__ bool fits(float k) { return BF16 || fabsf(k) < 32768.f; }

    // k: ALiBi's slope in raw units (Alibi::slope).
    template <bool BF16>
    __device__ __forceinline__ AlibiProducts(float k, Constant<BF16>) {
        const float hi = to_float<BF16>(to_16bit<BF16>(k)), rest = k - hi;
        const float mid = to_float<BF16>(to_16bit<BF16>(rest)), lo = rest - mid;
        const int t = threadIdx.x % 4;
        word = t == 0 ? pack_pair<BF16>(hi, mid) : t == 1 ? pack_pair<BF16>(lo, 0.f) : 0u;
    }
};

template <int HEADDIM, int BLOCK_N, int STAGES, int CONSUMERS, bool LOCAL = false, bool BIAS_TILES = false,
          int FEATURES = 0>
struct Sm90FwdTile {
    static constexpr int kBlockM = 64 * CONSUMERS;          // a consumer warpgroup's 64 rows each
    static constexpr int kThreads = 128 * (1 + CONSUMERS);
    // The LOCAL kernels hand every tile to the consumers through its Q buffer's slot, so that a
    // call may take them from a counter (next_tile).
    static constexpr bool kTileSlots = LOCAL;
    static constexpr int kQBytes = kBlockM * HEADDIM * 2;
    static constexpr int kKVBytes = BLOCK_N * HEADDIM * 2;  // one K or V buffer
    // The dynamic shared memory's start is aligned up to 1024 bytes (the swizzle's atom) in the
    // kernel. Q has two buffers with two consumers where they fit (the producer loads a tile's Q
    // while the consumers work on the tile before), else one (three consumers' LOCAL kernels spill
    // with the second's bookkeeping). After the barriers, a Q buffer's tile index (8 bytes each).
    // A kernel whose attn_bias comes in tiles (BIAS_TILES: a 16-bit bias with aligned rows, which
    // the call's plan maps) has a ring of them beside K's (a tile's rows by BLOCK_N keys, in 64-key
    // column blocks), which the producer copies with K. Other biases are the consumers' own reads, a
    // block's products ahead, which leave their latency in every block's softmax.
    static constexpr int kBiasTileBytes = kBlockM * BLOCK_N * 2;
    // ALiBi's column terms by the tensor cores (AlibiProducts), with B's tile after O's buffer: where
    // ALiBi comes without softcap (whose tanh takes the score before ALiBi) on two consumers (three
    // run serial, short of registers) and 128-key blocks, but for hd128's LOCAL kernels (causal,
    // windows), measured 1.5-2% slower with the product where the others gained 2-10% (bench/notes/v92).
    static constexpr bool kAlibiProducts = (FEATURES & feature::alibi) != 0 && (FEATURES & feature::softcap) == 0
                                           && BLOCK_N == 128 && CONSUMERS == 2 && !(LOCAL && HEADDIM > 64);
    static constexpr int kAlibiTileBytes = kAlibiProducts ? AlibiProducts::kTileBytes : 0;
    static constexpr int smem_bytes_with(int q_buffers, bool bias_tiles) {
        return 1024 + q_buffers * kQBytes + 2 * STAGES * kKVBytes + (bias_tiles ? STAGES * kBiasTileBytes : 0)
               + kAlibiTileBytes + 8 * (3 * q_buffers + 4 * STAGES);
    }
    static constexpr bool kBiasTiles = BIAS_TILES;
    static_assert(!BIAS_TILES || (BLOCK_N % 64 == 0 && smem_bytes_with(1, true) <= 227 * 1024),
                  "the ring of bias tiles fits beside one Q buffer, in 64-key column blocks");
    static constexpr int kQBuffers = CONSUMERS == 2 && smem_bytes_with(2, kBiasTiles) <= 227 * 1024 ? 2 : 1;
    // O leaves through a buffer of its own (stage_rows) where one fits (hd64, and hd128 on two
    // stages), else straight from the registers. Measured on the H200 (v39): +5.5% at hd128 1k
    // causal, +2% at hd64 4k; hd64's two consumers (the tile of at most 1k rows) 3% slower with it.
    static constexpr bool kStagedO =
        smem_bytes_with(kQBuffers, kBiasTiles) + kQBytes <= 227 * 1024 && !(HEADDIM == 64 && CONSUMERS == 2);
    static constexpr int kSmemBytes = smem_bytes_with(kQBuffers, kBiasTiles) + (kStagedO ? kQBytes : 0);
    // Registers per thread: the producer gives all but 24 to the consumers; with tile slots it
    // spills at 24 and keeps 32, but at hd256 without bias tiles (whose consumers, at 240 with 80
    // keys a block, have none to give; on 64 keys they have 8). A CTA starts with kLaunchRegisters
    // per thread (65536 / kThreads, as ptxas rounds it) and setmaxnreg only moves them between
    // warpgroups: a consumer that asks for more than the producer gave up waits for ever.
    static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
    static constexpr int kProducerRegisters = kTileSlots && (HEADDIM < 256 || kBiasTiles) ? 32 : 24;
    static constexpr int kConsumerRegisters = CONSUMERS == 3 ? 160 : kProducerRegisters == 32 ? 232 : 240;
    static_assert(kProducerRegisters + CONSUMERS * kConsumerRegisters <= (1 + CONSUMERS) * kLaunchRegisters,
                  "the consumers' registers are the producer's");
    // Measured on the H200: taking turns pays at hd64 and hd128 (+18%, +2% at 16k) and costs at
    // hd256 (-8%), whose longer products leave the softmax hidden anyway.
    static constexpr bool kPingPong = HEADDIM < 256;
    // Three consumers have 160 registers each: the operand descriptors that ptxas would compute
    // ahead of their products (two registers each) spill there. Two consumers have room for them.
    static constexpr bool kDescriptorsInOrder = CONSUMERS == 3;
    // A 16-bit bias is read as words (common/score.cuh, added_as_words), and a block's bias asked of
    // L1 before its Q K^T, by two consumers; three, at 160 registers each, spill with the code for
    // it. The words load just before they join the scores: loaded before Q K^T, to hide their
    // latency under it, their registers slowed dropout by a fifth.
    static constexpr bool kBiasWords = CONSUMERS == 2 && !kBiasTiles;
    static_assert(HEADDIM % 64 == 0 && HEADDIM <= 256, "tiles are whole 64-wide column blocks");
    static_assert(BLOCK_N % 16 == 0, "S is one wgmma wide (wgmma_ss), P V takes whole 16-key steps");
};

// Tile t: the blocks are walked from the last (under a causal mask the heaviest) to the first,
// and, as grid_slot orders them, block-major (every head's heavy blocks first) where
// p.block_major says so, else head-major (a head's blocks together, sharing K and V in L2).
// Block-major goes through the (batch entry, head) pairs in groups of p.block_major, each group's
// blocks level by level: a group's K and V stay in L2 while its levels pass, and a round of
// gridDim.x tiles spans few levels, so its tiles weigh about the same.
// CTA c takes tile c of each round of gridDim.x tiles in even rounds and tile gridDim.x - 1 - c
// in odd ones: with weights falling along the order, a plain c, c + gridDim.x, ... would give CTA 0
// the heaviest tile of every round (a quarter more work than the last CTA at hd256, 16k, causal).
// A LOCAL call whose pairs' K and V do not all fit the L2 takes its tiles from a counter instead
// (next_tile): groups that fit make rounds of tiles of uneven weight, which a static turn leaves
// unbalanced (bench/notes/v26, v36).
struct FwdTileSlot {
    int m_block, head, batch;
};

__device__ __forceinline__ int round_tile(int round) {
    return round * gridDim.x + (round & 1 ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
}

// The producer's next tile: round `round`'s, or where a kernel with tile slots has a counter
// (p.tile_counter, zeroed by the call's plan) the counter's next. The consumers of a kernel with
// tile slots read it from the tile's Q buffer slot.
template <bool TILE_SLOTS>
__device__ __forceinline__ int next_tile(const FlashParams& p, int round) {
    if (!TILE_SLOTS) return round_tile(round);
    if (p.tile_counter != nullptr) return atomicAdd(p.tile_counter, 1);
    // round_tile's, with the grid read here (volatile), not held in registers across the loop:
    // hd256's producer has 24
    unsigned ctas, cta;
    asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(ctas));
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cta));
    return round * int(ctas) + int(round & 1 ? ctas - 1 - cta : cta);
}

template <bool LOCAL>
__device__ __forceinline__ FwdTileSlot fwd_tile(const FlashParams& p, int t, int m_blocks) {
    int block, pair;
    if (LOCAL && p.block_major) {
        const int group = t / (p.block_major * m_blocks), first = group * p.block_major;
        const int pairs = min(p.block_major, p.nheads * p.batch - first), rest = t - first * m_blocks;
        block = rest / pairs;
        pair = first + rest - block * pairs;
    } else {
        pair = t / m_blocks;
        block = t - pair * m_blocks;
    }
    const int batch = pair / p.nheads;
    return FwdTileSlot{m_blocks - 1 - block, pair - batch * p.nheads, batch};
}

template <int HEADDIM, int BLOCK_N, int STAGES, int CONSUMERS, bool BF16, bool LOCAL, int FEATURES, bool BIAS_TILES>
__device__ __forceinline__ void flash_fwd_sm90(const FlashParams& p, const FwdMaps& maps) {
    typedef Sm90FwdTile<HEADDIM, BLOCK_N, STAGES, CONSUMERS, LOCAL, BIAS_TILES, FEATURES> T;
    static_assert(!BIAS_TILES || (FEATURES & feature::bias) != 0, "bias tiles are an attn_bias's");
    constexpr bool SLOTS = T::kTileSlots;
    constexpr bool OPTIONS = FEATURES != 0, DROPOUT = (FEATURES & feature::dropout) != 0;  // (as in sm80/fwd.cuh)
    constexpr int BLOCK_M = T::kBlockM, NT = BLOCK_N / 8, DT = HEADDIM / 8;
    constexpr int kOWidth = HEADDIM == 64 ? 64 : 128;  // columns of O per P V wgmma

    constexpr int QB = T::kQBuffers;
    // Tiles back to back: a tile's last P V runs beside the next tile's first Q K^T, its O stored
    // after (short tiles spend much of their time starting and ending). It needs the next tile's Q
    // loaded ahead (a second buffer), and the options' registers are spoken for.
    constexpr bool kCarry = !OPTIONS && QB == 2;
    // O through its buffer (T::kStagedO), but in the options' kernels of two consumers: at 232
    // registers (LOCAL, hd128) they spill 8 bytes with it.
    constexpr bool kStageO = T::kStagedO && !(OPTIONS && CONSUMERS == 2);
    // Else O leaves as 16-byte chunks transposed over each quad (for_each_quad_chunk; v72, H100: hd256
    // 1k +15%, 16k +1.5-2.5%, hd128 16k +1.5%), but where measured slower (hd64's two consumers, 2.4%
    // at 1k) or spilling (the LOCAL options' kernels that read a bias as words, at 232 or 240
    // registers): as the fragments' words there.
    constexpr bool kQuadChunks = !(HEADDIM == 64 && CONSUMERS == 2) && !(OPTIONS && LOCAL && T::kBiasWords);

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32 s_q0 = (smem_address(smem_raw) + 1023) & ~1023u;
    auto s_q = [&](int buffer) { return s_q0 + buffer * T::kQBytes; };
    auto s_k = [&](int stage) { return s_q0 + QB * T::kQBytes + stage * 2 * T::kKVBytes; };
    auto s_v = [&](int stage) { return s_k(stage) + T::kKVBytes; };
    auto s_bias = [&](int stage) { return s_q0 + QB * T::kQBytes + 2 * STAGES * T::kKVBytes + stage * T::kBiasTileBytes; };
    const uint32 s_o = s_bias(T::kBiasTiles ? STAGES : 0);  // (kStagedO)
    const uint32 s_alibi = s_o + (T::kStagedO ? T::kQBytes : 0);  // (kAlibiProducts)
    const uint32 barriers = s_alibi + T::kAlibiTileBytes;
    auto q_full = [&](int buffer) { return barriers + 8 * buffer; };
    auto q_empty = [&](int buffer) { return barriers + 8 * (QB + buffer); };
    auto k_full = [&](int stage) { return barriers + 8 * (2 * QB + stage); };
    auto v_full = [&](int stage) { return barriers + 8 * (2 * QB + STAGES + stage); };
    auto k_empty = [&](int stage) { return barriers + 8 * (2 * QB + 2 * STAGES + stage); };
    auto v_empty = [&](int stage) { return barriers + 8 * (2 * QB + 3 * STAGES + stage); };
    // With tile slots: the index of the tile whose Q buffer `buffer` holds, written before its q_full arrival
    auto tile_slot = [&](int buffer) { return barriers + 8 * (2 * QB + 4 * STAGES + buffer); };

    const int m_blocks = ceil_div(p.seqlen_q, BLOCK_M), tiles = m_blocks * p.nheads * p.batch;
    // Broadcast where it pays: at hd64 the descriptors then leave vector registers (+7-9%); hd128
    // gains nothing measurable, and hd256's LOCAL kernel spills with it (v44 note).
    const int warpgroup = warpgroup_index<HEADDIM == 64>();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int buffer = 0; buffer < QB; ++buffer) {
            mbarrier_init(q_full(buffer), 1);
            mbarrier_init(q_empty(buffer), 4 * CONSUMERS);  // the consumers' warps
        }
#pragma unroll
        for (int stage = 0; stage < STAGES; ++stage) {
            mbarrier_init(k_full(stage), 1);
            mbarrier_init(v_full(stage), 1);
            mbarrier_init(k_empty(stage), 4 * CONSUMERS);
            mbarrier_init(v_empty(stage), 4 * CONSUMERS);
        }
        fence_mbarrier_init();
    }
    if (T::kAlibiProducts && threadIdx.x < AlibiProducts::kTileBytes / 16) {
        AlibiProducts::write_tile<BF16>(s_alibi, threadIdx.x);
        fence_proxy_async();  // (read by wgmma)
    }
    __syncthreads();

    if (warpgroup == 0) {
        setmaxnreg_dec<T::kProducerRegisters>();
        if (threadIdx.x != 0) return;
        int i = 0, q_loads = 0;  // the ring's step; tiles that took a Q buffer
        // A Q buffer for tile t; with tile slots t goes to the consumers in its slot, every tile's (the end's,
        // t >= tiles, and those without a load too: then `arrive`, with no bytes to wait for).
        auto take_q_buffer = [&](int t, bool arrive) {
            const int q_buffer = q_loads % QB;
            if (q_loads >= QB) mbarrier_wait(q_empty(q_buffer), (q_loads / QB - 1) & 1);
            ++q_loads;
            if (SLOTS) st_shared_u32(tile_slot(q_buffer), t);
            if (arrive) mbarrier_arrive(q_full(q_buffer));
            return q_buffer;
        };
        for (int round = 0;; ++round) {
            const int t = next_tile<SLOTS>(p, round);
            if (t >= tiles) {
                if (SLOTS) take_q_buffer(t, true);
                break;
            }
            const FwdTileSlot tile = fwd_tile<LOCAL>(p, t, m_blocks);
            const Sequence seq(p, tile.batch);
            const int row0 = tile.m_block * BLOCK_M;
            const BlockRange blocks = key_blocks_seen<LOCAL>(p, seq, row0, BLOCK_M, BLOCK_N);
            // (a varlen grid covers the longest sequence: a tile may have no rows)
            if (row0 >= seq.seqlen_q || blocks.end <= blocks.first) {
                if (SLOTS) take_q_buffer(t, true);
                continue;
            }
            const int batch_coord = p.cu_seqlens_q == nullptr ? tile.batch : 0;
            const int head_k = tile.head / (p.nheads / p.nheads_k);
            const int q_buffer = take_q_buffer(t, false);
            load_tile<BLOCK_M, HEADDIM>(s_q(q_buffer), &maps.q, q_full(q_buffer), seq.first_row_q + row0, tile.head,
                                        batch_coord);
            for (int n_block = blocks.end - 1; n_block >= blocks.first; --n_block, ++i) {
                const int stage = i % STAGES, reuse = ((i / STAGES) & 1) ^ 1;
                const int key_row = seq.first_row_k + n_block * BLOCK_N;
                if (i >= STAGES) mbarrier_wait(k_empty(stage), reuse);
                load_tile<BLOCK_N, HEADDIM>(s_k(stage), &maps.k, k_full(stage), key_row, head_k, batch_coord,
                                            T::kBiasTiles ? p.bias_box_rows * BLOCK_N * 2 : 0);
                if constexpr (T::kBiasTiles) {  // (its bytes are k_full's too; a box past the sequence reads as zeros)
                    const int3 at = Bias<BF16>::map_coordinates(p, tile.batch, tile.head, row0);
                    copy_column_blocks<BLOCK_M, BLOCK_N>(s_bias(stage), &maps.bias, k_full(stage), n_block * BLOCK_N,
                                                         at.x, at.y, at.z);
                }
                if (i >= STAGES) mbarrier_wait(v_empty(stage), reuse);
                load_tile<BLOCK_N, HEADDIM>(s_v(stage), &maps.v, v_full(stage), key_row, head_k, batch_coord);
            }
        }
        return;
    }

    setmaxnreg_inc<T::kConsumerRegisters>();
    const int wg_row0 = (warpgroup - 1) * 64;  // this warpgroup's rows in the tile
    const int warp_row0 = wg_row0 + 16 * (threadIdx.x / 32 % 4);
    const bool arrives = threadIdx.x % 32 == 0;  // one arrival per warp on the empty barriers

    // Turns, round the consumers (named barriers 1 to CONSUMERS): each issues after the one before
    // it has (the first goes first) and hands the turn on. All issue equally often, so the last's
    // first hand-over is absorbed by the first's last wait.
    const int my_turn = warpgroup, next_turn = warpgroup % CONSUMERS + 1;
    if (T::kPingPong && warpgroup == CONSUMERS) consumers_arrive(next_turn);
    auto take_turn = [&]() { if (T::kPingPong) consumers_sync(my_turn); };
    auto pass_turn = [&]() { if (T::kPingPong) consumers_arrive(next_turn); };

    const float bound = score_bound<FEATURES, BF16>(p);  // (here: in the loop ptxas works it out every block)
    float acc_o[1][DT][4];
    uint32 p_frag[BLOCK_N / 16][4];  // the previous block's P, whose P V is issued with the next Q K^T
    // The options' kernels of three consumers (160 registers each) are serial, short of registers:
    // each P V completes before the softmax, the loop body is one copy with a run-time first-block
    // flag, and the previous block's ring stage is derived from i, not kept.
    constexpr bool kSerial = OPTIONS && CONSUMERS == 3;
    int i = 0, q_loads = 0;  // as the producer counts them
    // The previous block's ring stage and phase (of the V its P V reads): kept from that block,
    // measured 7% faster at hd256 than derived from i at the P V.
    int kept_stage = 0, kept_phase = 0;
    auto pending_stage = [&]() { return kSerial ? (i - 1) % STAGES : kept_stage; };
    auto pending_phase = [&]() { return kSerial ? ((i - 1) / STAGES) & 1 : kept_phase; };

    // The previous block's P V (its V has landed), and its completion.
    auto issue_pv = [&]() {
        const uint64 v_desc = n_major_descriptor(s_v(pending_stage()), 0, BLOCK_N);
        static_for<BLOCK_N / 16>([&](auto kk_) {
            static_for<HEADDIM / kOWidth>([&](auto part_) {
                constexpr int kk = decltype(kk_)::value, part = decltype(part_)::value;
                constexpr uint32 kBytes = (part * (kOWidth / 64) * BLOCK_N + kk * 16) * kSwizzleRowBytes;
                wgmma_rs<kOWidth, BF16>(reinterpret_cast<float(&)[kOWidth / 2]>(acc_o[0][part * kOWidth / 8]), p_frag[kk],
                                        descriptor_plus<kBytes, T::kDescriptorsInOrder>(v_desc), true);
            });
        });
        wgmma_commit();
    };
    auto complete_pv = [&]() {
        wgmma_wait<0>();
        fence_operands(flat(acc_o));
        if (arrives) mbarrier_arrive(v_empty(pending_stage()));
    };

    // After tile t's last block: O normalised and stored, and the rows' lse.
    auto finish_tile = [&](const float(&row_max)[1][2], const float(&row_sum)[1][2], int t) {
        const FwdTileSlot tile = fwd_tile<LOCAL>(p, t, m_blocks);
        const Sequence seq(p, tile.batch);
        const int row0 = tile.m_block * BLOCK_M + warp_row0;
        const float out_scale = DROPOUT && p.dropout_scale != 0.f ? p.dropout_scale : 1.f;
        finish_rows(acc_o, row_max, row_sum, out_scale, p, score_unit<FEATURES>(p),
                    p.lse + seq.stats_row0(p, tile.batch, tile.head), row0, seq.seqlen_q);
        uint16* out = static_cast<uint16*>(p.out) + tile.batch * p.out_batch_stride + tile.head * p.out_head_stride
                      + seq.first_row_q * p.out_row_stride;
        if constexpr (kStageO) {  // (out is the plan's own array: rows 16-byte aligned)
            const uint32 stage = s_o + wg_row0 * 2 * HEADDIM;
            __syncwarp();  // (the warp's lanes are done reading the last tile's rows)
            stage_rows<BF16>(stage, acc_o, 1.f);
            __syncwarp();
            const int stage_row0 = tile.m_block * BLOCK_M + wg_row0;
            for_each_staged_chunk<DT>([&](int row, int chunk, uint32 offset) {
                const uint4 value = ld_shared_u128(stage + offset);
                if (stage_row0 + row < seq.seqlen_q && 8 * chunk < p.headdim)
                    st_global_u128(out + (stage_row0 + row) * p.out_row_stride + 8 * chunk, value);
            });
        } else if constexpr (kQuadChunks) {
            const int rows[2] = {row0 + fragment_row(0, 0), row0 + fragment_row(0, 2)};
            uint16* const row_out[2] = {out + rows[0] * p.out_row_stride, out + rows[1] * p.out_row_stride};
            for_each_quad_chunk<BF16>(acc_o, 1.f, [&](int half, int col, uint4 chunk) {
                if (rows[half] < seq.seqlen_q && col < p.headdim) st_global_u128(row_out[half] + col, chunk);
            });
        } else {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + fragment_row(0, 2 * half);
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
    };

    // The last block's P V (its V has landed), alone.
    auto last_pv = [&]() {
        mbarrier_wait(v_full(pending_stage()), pending_phase());
        take_turn();
        wgmma_fence();
        issue_pv();
        pass_turn();
        complete_pv();
    };
    // kCarry: the tile whose last P V is pending (in p_frag), and its rows' statistics.
    bool carried = false;
    int carried_t = 0;
    float carried_max[1][2], carried_sum[1][2];
    auto finish_carried = [&]() {
        last_pv();
        finish_tile(carried_max, carried_sum, carried_t);
        carried = false;
    };

    for (int round = 0;; ++round) {
        // With tile slots the tile is the producer's, read from its Q buffer's slot once q_full completes
        // (for a tile without a load, on the producer's arrival alone); its warps arrive on
        // q_empty when done with it, at the end of its last Q K^T or here where it has none. The
        // lane that arrives for its warp reads the slot, so that the read is ordered before the
        // producer's next write.
        const int q_buffer = q_loads % QB;
        if (SLOTS) mbarrier_wait(q_full(q_buffer), (q_loads++ / QB) & 1);
        const int t = SLOTS ? __shfl_sync(0xffffffffu, arrives ? static_cast<int>(ld_shared_u32(tile_slot(q_buffer))) : 0, 0)
                            : round_tile(round);
        if (t >= tiles) break;
        const FwdTileSlot tile = fwd_tile<LOCAL>(p, t, m_blocks);
        const int head = tile.head, batch = tile.batch;
        const Sequence seq(p, batch);
        const int row0 = tile.m_block * BLOCK_M;
        const bool has_rows = row0 < seq.seqlen_q;
        const BlockRange blocks = key_blocks_seen<LOCAL>(p, seq, row0, BLOCK_M, BLOCK_N);
        const bool sees_keys = has_rows && blocks.end > blocks.first;
        if (SLOTS && !sees_keys && arrives) mbarrier_arrive(q_empty(q_buffer));
        if (!has_rows) continue;
        if (kCarry && carried && !sees_keys) finish_carried();  // its rows are zeros: the carried tile ends first
        if (!kCarry || !carried) zero(acc_o);  // (else after the carried tile's O has left, in the first block)
        float row_max[1][2] = {{-CUPYFLASH_INF, -CUPYFLASH_INF}}, row_sum[1][2] = {{0.f, 0.f}};
        const ScoreMods<BF16, FEATURES> mods(p, seq, batch, head, T::kBiasTiles);  // OPTIONS only; dead code otherwise
        const float alibi_k = T::kAlibiProducts ? mods.alibi.slope : 0.f;
        [[maybe_unused]] const AlibiProducts alibi_a(alibi_k, Constant<BF16>());  // (kAlibiProducts)
        [[maybe_unused]] const bool alibi_fits = AlibiProducts::fits<BF16>(alibi_k);

        // Every block is computed by every consumer, even one whose keys a warpgroup's rows do
        // not see (its scores are all masked, so its P is zero): a branch around the products
        // would make ptxas serialise them. The first block has no P V to run beside its Q K^T
        // (`first`: a Constant, but a run-time flag in the serial kernels) but the carried tile's
        // (`carry_in`), whose O leaves after it; after the last block's Q K^T, Q is released to
        // the producer.
        enum Masking { kAll, kNone, kPerBlock };
        using Yes = Constant<true>;
        using No = Constant<false>;
        auto attend = [&](int n_block, auto masking, auto first, auto carry_in) {
            constexpr Masking MASKING = decltype(masking)::value;
            constexpr bool CARRY_IN = decltype(carry_in)::value;
            const int stage = i % STAGES, phase = (i / STAGES) & 1;
            const int key0 = n_block * BLOCK_N;
            const bool masked = MASKING == kAll
                                || (MASKING == kPerBlock
                                    && block_needs_mask<LOCAL>(p, seq, row0 + wg_row0, key0, 64, BLOCK_N));
            float s[1][NT][4];
            if constexpr ((FEATURES & feature::bias) != 0 && T::kBiasWords)  // the block's bias reads then wait on L1
                mods.bias.template prefetch<64, BLOCK_N>(row0 + wg_row0, key0);
            // kAlibiProducts: +1 where the warpgroup's keys sit left of every row's diagonal (ALiBi's
            // k is the slope), -1 right of it (minus the slope), 0 across it (ALiBi per element)
            [[maybe_unused]] int alibi_side = 0;
            uint32 alibi_word = 0u;
            if constexpr (T::kAlibiProducts) {
                const int first_row = row0 + wg_row0;
                alibi_side = !alibi_fits                                          ? 0
                             : key0 + BLOCK_N - 1 <= seq.diagonal(first_row)      ? 1
                             : key0 >= seq.diagonal(first_row + 63)               ? -1
                                                                                  : 0;
                alibi_word = alibi_side == 0 ? 0u : alibi_side > 0 ? alibi_a.word : alibi_a.word ^ 0x80008000u;
            }
            [[maybe_unused]] uint32 alibi_operand[4] = {alibi_word, alibi_word, 0u, 0u};
            if constexpr (T::kAlibiProducts) fence_operands(alibi_operand);  // (written before the products)
            mbarrier_wait(k_full(stage), phase);
            if (!first || CARRY_IN) mbarrier_wait(v_full(pending_stage()), pending_phase());
            take_turn();
            wgmma_fence();
            const uint64 q_desc = k_major_descriptor(s_q(q_buffer) + wg_row0 * kSwizzleRowBytes, 0, BLOCK_M);
            const uint64 k_desc = k_major_descriptor(s_k(stage), 0, BLOCK_N);
            static_for<HEADDIM / 16>([&](auto kk_) {
                constexpr int kk = decltype(kk_)::value;
                wgmma_ss<BLOCK_N, BF16>(flat(s),
                                        descriptor_plus<k_major_offset(kk, BLOCK_M), T::kDescriptorsInOrder>(q_desc),
                                        descriptor_plus<k_major_offset(kk, BLOCK_N), T::kDescriptorsInOrder>(k_desc), kk > 0);
            });
            if constexpr (T::kAlibiProducts)
                wgmma_rs<BLOCK_N, BF16>(flat(s), alibi_operand, AlibiProducts::descriptor(s_alibi), true);
            wgmma_commit();
            if (!first || CARRY_IN) issue_pv();
            pass_turn();
            if ((first && !CARRY_IN) || kSerial) {
                wgmma_wait<0>();
            } else {
                wgmma_wait<1>();  // S is ready; P V runs on
            }
            fence_operands(flat(s));
            if (arrives) {
                if (!T::kBiasTiles) mbarrier_arrive(k_empty(stage));  // (else once its bias tile is read)
                if (n_block == blocks.first) mbarrier_arrive(q_empty(q_buffer));
            }
            // (The serial kernels, short of registers, leave ALiBi by rows: by columns some spill.)
            typename RowShiftFor<1, (FEATURES & feature::alibi) != 0 && !kSerial, T::kAlibiProducts>::type shift = {};
            if constexpr (T::kAlibiProducts)
                if (alibi_side != 0) {
                    shift.alibi_added = true;
                    const float k = static_cast<float>(alibi_side) * alibi_k;
#pragma unroll
                    for (int half = 0; half < 2; ++half)
                        shift.value[0][half] =
                            k * static_cast<float>(key0 - seq.diagonal(row0 + warp_row0 + fragment_row(0, 2 * half)));
                }
            if constexpr (OPTIONS) apply_score_mods<T::kBiasWords>(s, mods, row0 + warp_row0, key0, shift);
            if constexpr (T::kBiasTiles) {
                add_swizzled_tile<BF16>(s, s_bias(stage), BLOCK_M, warp_row0, p.inv_softmax_scale, p.bias_box_rows == 1);
                if (arrives) mbarrier_arrive(k_empty(stage));
            }
            if (masked) mask_fragment<LOCAL>(s, p, seq, row0 + warp_row0, key0, -CUPYFLASH_INF);
            const SoftmaxStep<1> step = new_row_max(s, row_max, row_sum, p, score_unit<FEATURES>(p), shift, bound);
            exponentiate(s, row_sum, step, p, score_unit<FEATURES>(p), shift);
            if (!first || CARRY_IN) complete_pv();
            if constexpr (CARRY_IN) {
                finish_tile(carried_max, carried_sum, carried_t);
                zero(acc_o);
            }
            rescale(acc_o, step);
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                p_frag[kk][0] = pack_pair<BF16>(s[0][2 * kk][0], s[0][2 * kk][1]);
                p_frag[kk][1] = pack_pair<BF16>(s[0][2 * kk][2], s[0][2 * kk][3]);
                p_frag[kk][2] = pack_pair<BF16>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
                p_frag[kk][3] = pack_pair<BF16>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
            }
            // Dropout acts on the probabilities after the softmax: the sums keep every element.
            if (DROPOUT && p.dropout_scale != 0.f)
                apply_dropout_packed<1, NT>([&](int, int kk, int r) -> uint32& { return p_frag[kk][r]; }, p, batch,
                                            head, row0 + warp_row0, key0);
            kept_stage = stage;
            kept_phase = phase;
            ++i;
        };
        // As sm80: the masked blocks at the end of the range, the unmasked ones, then a window's
        // masked ones at its start, so the main loop has no mask code; the options' kernels mask
        // per block, in one loop.
        int n_block = blocks.end - 1;
        if (sees_keys) {
            if (!SLOTS) mbarrier_wait(q_full(q_buffer), (q_loads++ / QB) & 1);
            if constexpr (kSerial) {
                for (bool first = true; n_block >= blocks.first; --n_block, first = false)
                    attend(n_block, Constant<kPerBlock>(), first, No());
            } else if constexpr (OPTIONS) {
                attend(n_block--, Constant<kPerBlock>(), Yes(), No());
                for (; n_block >= blocks.first; --n_block) attend(n_block, Constant<kPerBlock>(), No(), No());
            } else {
                if (kCarry && carried)
                    attend(n_block--, Constant<kPerBlock>(), Yes(), Constant<kCarry>());
                else
                    attend(n_block--, Constant<kPerBlock>(), Yes(), No());
                const BlockRange unmasked = key_blocks_unmasked<LOCAL>(p, seq, row0, BLOCK_M, BLOCK_N, blocks);
                for (const int masked_first = max(unmasked.end, blocks.first); n_block >= masked_first; --n_block)
                    attend(n_block, Constant<kAll>(), No(), No());
                for (; n_block >= unmasked.first; --n_block) attend(n_block, Constant<kNone>(), No(), No());
                if constexpr (LOCAL)
                    for (; n_block >= blocks.first; --n_block) attend(n_block, Constant<kAll>(), No(), No());
            }
            if constexpr (kCarry) {
                carried = true;
                carried_t = t;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    carried_max[0][half] = row_max[0][half];
                    carried_sum[0][half] = row_sum[0][half];
                }
                continue;
            }
            last_pv();
        }
        finish_tile(row_max, row_sum, recomputed(t));
    }
    if (kCarry && carried) finish_carried();
    if (T::kPingPong && warpgroup == 1) take_turn();  // the last consumer's first hand-over
}
