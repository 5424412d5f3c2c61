// Backward pass, in three kernels:
//   flash_bwd_dot:        D = rowsum(dout * out) and lse in base 2, fp32, one warp per query row;
//                         also zeroes the row's dq_accum (one launch fewer than a separate memset).
//   flash_bwd:            one CTA per (key block, kv head, batch). K and V stay in shared memory
//                         while the CTA walks the query blocks of every query head of its kv group
//                         (so GQA needs no expanded dk/dv buffers and no reduction). Per query block:
//                           S = Q K^T, dP = dO V^T, P = 2^(S * scale_log2 - lse_log2) (from the saved lse),
//                           dS = P * (dP - D); P and dS go to shared memory; dV += P^T dO, dK += dS^T Q
//                           in registers; dQ += dS K by fp32 atomics into dq_accum.
//                         With STAGES = 2, Q, dO, lse and D have two buffers: the next query block
//                         loads during the whole of the current step, and a step needs two barriers.
//                         The plain kernels may split the key blocks of the last partial wave over
//                         several CTAs (TailSplit), which sum dK and dV in fp32.
//   flash_bwd_convert_dq: dq = dq_accum * scale, in the input dtype. (Not after the sm90 backward
//                         where the keys are one block: p.dq_stored_by_bwd, sm90/bwd.cuh.)
// As in the forward, LOCAL kernels bound each row's keys and FEATURES adds the options of
// common/score.cuh (OPTIONS: any; they return dbias); DETERMINISTIC kernels add dQ in a fixed order.
#pragma once
#include "../common/mask.cuh"
#include "../common/math.cuh"
#include "../common/score.cuh"
#include "bwd_schedule.cuh"
#include "tile.cuh"

template <int HEADDIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES>
struct BwdTile {
    static constexpr int kThreads = WARPS * 32;
    typedef WarpGrid<BLOCK_M, BLOCK_N, WARPS> S;      // S, dP, P, dS
    typedef WarpGrid<BLOCK_N, HEADDIM, WARPS> KV;     // dK, dV
    typedef WarpGrid<BLOCK_M, HEADDIM, WARPS> Q;      // dQ
    static constexpr int kQStage = TileLayout<HEADDIM>::template bytes<2 * BLOCK_M>() + 2 * BLOCK_M * 4;  // Q, dO, lse, D
    static constexpr int kSmemBytes = TileLayout<HEADDIM>::template bytes<2 * BLOCK_N>()     // K, V
                                      + STAGES * kQStage
                                      + TileLayout<BLOCK_N>::template bytes<2 * BLOCK_M>();  // P, dS
    static_assert(BLOCK_M <= kThreads, "one thread loads each row's lse and D");
    static_assert(TileLayout<HEADDIM>::template bytes<BLOCK_N>() % 128 == 0 && kQStage % 128 == 0
                  && TileLayout<BLOCK_N>::template bytes<BLOCK_M>() % 128 == 0,
                  "every tile starts on a 128-byte boundary, as swizzled tiles need");
    static_assert(STAGES == 1 || STAGES == 2, "one or two query-side buffers");
};

// The OPTIONS kernels' elementwise step, all in one pass over the S and dP fragments of a warp
// whose tile starts at (row0, col0): the score options, P, dropout, dS (and dbias). On return s
// holds what dV needs (P, dropped and rescaled) and dp the gradient of the raw scores (dS times
// the modifiers' d/ds). lse and dot point at the warp's first row.
template <bool BF16, bool LOCAL, int FEATURES, int MT, int NT>
__device__ __forceinline__ void options_probabilities(float (&s)[MT][NT][4], float (&dp)[MT][NT][4], const FlashParams& p,
                                                     const Sequence& seq, int batch, int head, int row0, int col0,
                                                     bool masked, const float* lse, const float* dot) {
    // ALiBi without softcap (which applies before it) adds by rows, an add and an FMA an element
    // (common/score.cuh), ahead of the per-element pass, which would convert each element's distance.
    // (Not beside a bias: ptxas then unswitches the per-element pass into longer code.)
    constexpr bool kAlibiByRows = (FEATURES & (feature::softcap | feature::alibi | feature::bias)) == feature::alibi;
    if constexpr (kAlibiByRows) {
        const Alibi alibi(p, seq, batch, head);
        if (alibi.on()) added_by_rows(s, alibi, row0, col0);
    }
    const ScoreMods<BF16, kAlibiByRows ? FEATURES & ~feature::alibi : FEATURES> mods(p, seq, batch, head);
    const BiasGradient<BF16> dbias(p, batch, head);
    const bool dropout = (FEATURES & feature::dropout) != 0 && p.dropout_scale != 0.f;
    for_each_dropout_decision<MT, NT>(p, dropout, batch, head, row0, col0, [&](int mt, int nt, int e, bool kept) {
        const int r = fragment_row(mt, e), row = row0 + r, col = col0 + fragment_col(nt, e);
        const bool in_bounds = row < seq.seqlen_q && col < seq.seqlen_k;
        float grad = 1.f;
        const float x = mods.apply(s[mt][nt][e], row, col, grad);
        float prob = fast_exp2(fmaf(x, p.scale_log2, -lse[r]));
        if (masked && !is_visible<LOCAL>(p, seq, row, col)) prob = 0.f;
        // Dropout: dV sees the kept P times p.dropout_scale, and the gradient reaching P is dP times the same.
        const float drop = !dropout ? 1.f : (kept ? p.dropout_scale : 0.f);
        const float ds = prob * (dp[mt][nt][e] * drop - dot[r]);
        if ((FEATURES & feature::bias) != 0 && dbias.matrix != nullptr && in_bounds) dbias.add(row, col, ds);
        s[mt][nt][e] = prob * drop;
        dp[mt][nt][e] = ds * grad;
    });
}

template <int HEADDIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES, bool BF16, bool LOCAL, bool EVEN_K,
          int FEATURES, bool DETERMINISTIC>
__device__ __forceinline__ void flash_bwd(const FlashParams& p) {
    typedef BwdTile<HEADDIM, BLOCK_M, BLOCK_N, WARPS, STAGES> T;
    constexpr bool OPTIONS = FEATURES != 0;
    // The light options (_kernels.LIGHT_FEATURES) run in the plain kernels' passes: ALiBi alone added
    // by rows ahead of them, dropout alone drawn in dS's, softcap alone in one pass that makes P and
    // dS together (dS takes each element's tanh).
    constexpr bool kAlibiAlone = FEATURES == feature::alibi && !DETERMINISTIC;
    constexpr bool kDropoutAlone = FEATURES == feature::dropout && !DETERMINISTIC;
    constexpr bool kSoftcapAlone = FEATURES == feature::softcap && !DETERMINISTIC;
    constexpr bool kPlainPasses = !OPTIONS || kAlibiAlone || kDropoutAlone || kSoftcapAlone;
    typedef typename T::S GS;
    typedef typename T::KV GKV;
    typedef typename T::Q GQ;
    constexpr int kStride = TileLayout<HEADDIM>::kStride;
    __builtin_assume(threadIdx.x < T::kThreads);  // every thread is active in the tile copies, without a test
    // The hd256 kernels with two stages XOR dK's and dV's operand addresses after the step
    // (TileLayout::moved): XORed bases kept live cost registers, and those kernels would spill.
    constexpr bool kXorLast = HEADDIM == 256 && STAGES == 2;

    extern __shared__ __align__(128) uint16 smem[];
    uint16* s_k = smem;
    uint16* s_v = s_k + BLOCK_N * kStride;
    uint16* s_p = s_v + BLOCK_N * kStride;
    uint16* s_ds = s_p + BLOCK_M * TileLayout<BLOCK_N>::kStride;
    uint16* s_stages = s_ds + BLOCK_M * TileLayout<BLOCK_N>::kStride;
    // Stage i: Q, dO (BLOCK_M rows each), then lse and D (BLOCK_M floats each).
    auto s_q = [&](int stage) { return s_stages + stage * (T::kQStage / 2); };
    auto s_do = [&](int stage) { return s_q(stage) + BLOCK_M * kStride; };
    auto s_lse = [&](int stage) { return reinterpret_cast<float*>(s_do(stage) + BLOCK_M * kStride); };
    auto s_dot = [&](int stage) { return s_lse(stage) + BLOCK_M; };

    // The first key blocks first: with a causal mask the most query blocks see them (grid_slot).
    // The plain kernels may split the last partial wave (TailSplit); never the DETERMINISTIC ones,
    // whose split dK and dV would be summed in a run-dependent order.
    constexpr bool kMaySplit = !LOCAL && !OPTIONS && !DETERMINISTIC;
    const TailSplit tail(p, grid_slot<LOCAL>(p), kMaySplit);
    if (tail.idle) return;
    const int n_block = tail.slot.block, head_k = tail.slot.head, batch = tail.slot.batch;
    const int key0 = n_block * BLOCK_N;
    const Sequence seq(p, batch);
    if (key0 >= seq.seqlen_k) return;  // a varlen grid covers the longest sequence
    const int group = p.nheads / p.nheads_k;
    const BlockRange query_blocks = query_blocks_seeing<LOCAL>(p, seq, key0, BLOCK_M, BLOCK_N);
    const int query_steps = query_blocks.end - query_blocks.first;
    int steps = group * query_steps;

    const uint16* k = static_cast<const uint16*>(p.k) + batch * p.k_batch_stride + head_k * p.k_head_stride
                      + (seq.first_row_k + key0) * p.k_row_stride;
    const uint16* v = static_cast<const uint16*>(p.v) + batch * p.v_batch_stride + head_k * p.v_head_stride
                      + (seq.first_row_k + key0) * p.v_row_stride;
    copy_tile_async<BLOCK_N, HEADDIM, T::kThreads, !EVEN_K>(s_k, k, p.k_row_stride, seq.seqlen_k - key0, p.headdim);
    copy_tile_async<BLOCK_N, HEADDIM, T::kThreads, !EVEN_K>(s_v, v, p.v_row_stride, seq.seqlen_k - key0, p.headdim);

    const QueryWalk<BLOCK_M, DETERMINISTIC, LOCAL> walk{query_blocks};  // (common/mask.cuh)
    // Loads Q, dO, lse_log2 and D of a query block into a stage; rows past the end are zero-filled.
    auto load_step = [&](int head, int row0, int stage) {
        const uint16* q = static_cast<const uint16*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride
                          + (seq.first_row_q + row0) * p.q_row_stride;
        const uint16* dout = static_cast<const uint16*>(p.dout) + batch * p.dout_batch_stride
                             + head * p.dout_head_stride + (seq.first_row_q + row0) * p.dout_row_stride;
        copy_tile_async<BLOCK_M, HEADDIM, T::kThreads, !EVEN_K>(s_q(stage), q, p.q_row_stride, seq.seqlen_q - row0,
                                                                p.headdim);
        copy_tile_async<BLOCK_M, HEADDIM, T::kThreads, !EVEN_K>(s_do(stage), dout, p.dout_row_stride,
                                                                seq.seqlen_q - row0, p.headdim);
        if (threadIdx.x < BLOCK_M) {
            const long long row = seq.padded_row0(p, batch, head) + row0 + threadIdx.x;
            const bool valid = row0 + threadIdx.x < seq.seqlen_q;
            cp_async_4(smem_address(s_lse(stage) + threadIdx.x), valid ? p.lse_log2 + row : p.lse_log2, valid);
            cp_async_4(smem_address(s_dot(stage) + threadIdx.x), valid ? p.dout_dot_out + row : p.dout_dot_out, valid);
        }
    };
    int head = head_k * group, row0 = walk.first_row0();  // the current step's query block
    if (kMaySplit && tail.unit >= 0) {
        const int first = tail.first(steps, p);
        steps = tail.count(steps, p);
        head += first / query_steps;
        row0 += first % query_steps * BLOCK_M;
    }
    if (steps > 0) load_step(head, row0, 0);
    cp_async_commit();

    float acc_dk[GKV::MT][GKV::NT][4], acc_dv[GKV::MT][GKV::NT][4];
    zero(acc_dk);
    zero(acc_dv);

    for (int step = 0; step < steps; ++step) {
        const int stage = STAGES == 2 ? step % 2 : 0;
        int next_head = head, next_row0 = row0;
        walk.advance(next_head, next_row0);
        cp_async_wait<0>();
        __syncthreads();  // this step's Q, dO, lse, D (and K, V) have landed; every warp is done with the last step
        if (STAGES == 2 && step + 1 < steps) load_step(next_head, next_row0, stage ^ 1);
        cp_async_commit();
        if constexpr ((FEATURES & feature::bias) != 0)  // the step's bias reads then wait on L1
            Bias<BF16>(p, seq, batch, recomputed(head)).prefetch<BLOCK_M, BLOCK_N, T::kThreads>(row0, key0);
        const uint16* sq = s_q(stage);
        const uint16* sdo = s_do(stage);

        float s[GS::MT][GS::NT][4], dp[GS::MT][GS::NT][4];
        zero(s);
        zero(dp);
        warp_gemm<BF16, GS::MT, GS::NT, HEADDIM, HEADDIM, true, HEADDIM, true>(s, sq, GS::row0(), s_k, GS::col0());
        warp_gemm<BF16, GS::MT, GS::NT, HEADDIM, HEADDIM, true, HEADDIM, true>(dp, sdo, GS::row0(), s_v, GS::col0());

        // P = 2^(S * scale_log2 - lse_log2). A row that sees no key has lse_log2 = +inf, so its P
        // is exactly 0. Rows past the end were zero-filled (Q, dO, lse_log2, D): their P is at most 1
        // but dO and dP - D are 0, so they add nothing to dV, dK or dQ.
        const bool masked = block_needs_mask<LOCAL>(p, seq, row0, key0, BLOCK_M, BLOCK_N);
        if constexpr (!kPlainPasses) {
            options_probabilities<BF16, LOCAL, FEATURES, GS::MT, GS::NT>(s, dp, p, seq, batch, head, row0 + GS::row0(),
                                                               key0 + GS::col0(), masked, s_lse(stage) + GS::row0(),
                                                               s_dot(stage) + GS::row0());
        } else {
            if constexpr (kAlibiAlone) {  // (the step's head's slope: a CTA walks its KV group's heads)
                const Alibi alibi(p, seq, batch, head);
                if (alibi.on()) added_by_rows(s, alibi, row0 + GS::row0(), key0 + GS::col0());
            }
            if constexpr (kSoftcapAlone) {
                // P of the capped scores and dS = P * (dP - D) * d/ds in one pass: every call that runs
                // these kernels has softcap on (their features are the options a call turns on).
                const Softcap softcap(p, seq, batch, head);
                for_each_element<GS::MT, GS::NT>([&](int mt, int nt, int e) {
                    const int r = GS::row0() + fragment_row(mt, e);
                    float grad = 1.f;
                    const float x = softcap.apply(s[mt][nt][e], 0, 0, grad);
                    const float prob = fast_exp2(fmaf(x, p.scale_log2, -s_lse(stage)[r]));
                    dp[mt][nt][e] = prob * (dp[mt][nt][e] - s_dot(stage)[r]) * grad;
                    s[mt][nt][e] = prob;
                });
            } else {
                // (Three passes rather than one: fused, the 255-register variants spill.)
                for_each_element<GS::MT, GS::NT>([&](int mt, int nt, int e) {
                    s[mt][nt][e] = fast_exp2(fmaf(s[mt][nt][e], p.scale_log2,
                                                  -s_lse(stage)[GS::row0() + fragment_row(mt, e)]));
                });
            }
            // A row's visible keys as one word of bits, made where it is used (rows' bounds held
            // across the pass make the LOCAL hd128 backward spill); softcap's dS is hidden with its P.
            if (masked) {
#pragma unroll
                for (int mt = 0; mt < GS::MT; ++mt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const uint32 seen = keys_seen<LOCAL>(p, seq, row0 + GS::row0() + fragment_row(mt, 2 * half),
                                                           key0 + GS::col0() + fragment_col(0, 0));
                        hide_unseen<GS::NT>(s[mt], 0, half, seen, 0.f);
                        if constexpr (kSoftcapAlone) hide_unseen<GS::NT>(dp[mt], 0, half, seen, 0.f);
                    }
            }
            // dS = P * (dP - D) (softcap's is made with its P)
            if constexpr (kDropoutAlone) {  // dP and dV's P: the kept elements times dropout_scale, the others 0
                for_each_dropout_decision<GS::MT, GS::NT>(p, p.dropout_scale != 0.f, batch, head, row0 + GS::row0(),
                                                         key0 + GS::col0(), [&](int mt, int nt, int e, bool kept) {
                    const float drop = p.dropout_scale == 0.f ? 1.f : (kept ? p.dropout_scale : 0.f);
                    dp[mt][nt][e] = s[mt][nt][e] * (dp[mt][nt][e] * drop - s_dot(stage)[GS::row0() + fragment_row(mt, e)]);
                    s[mt][nt][e] *= drop;
                });
            } else if constexpr (!kSoftcapAlone) {
                for_each_element<GS::MT, GS::NT>([&](int mt, int nt, int e) {
                    dp[mt][nt][e] = s[mt][nt][e] * (dp[mt][nt][e] - s_dot(stage)[GS::row0() + fragment_row(mt, e)]);
                });
            }
        }
        // stmatrix (a quarter of the pair stores, a few more live registers) for P where a warp's S
        // tile is 32 x 32 or wider, and for dS from 32 x 64 (hd32/hd64), in the plain passes: at hd128
        // both tiles by stmatrix spill, and P alone is 1-2% faster.
        if constexpr (GS::NT >= 4 && kPlainPasses)
            store_fragment_by_matrix<BF16, GS::MT, GS::NT, BLOCK_N>(s_p, s, GS::row0(), GS::col0());
        else
            store_fragment<BF16, GS::MT, GS::NT, BLOCK_N>(s_p, s, 1.f, GS::row0(), GS::col0());
        if constexpr (GS::NT >= 8 && kPlainPasses)
            store_fragment_by_matrix<BF16, GS::MT, GS::NT, BLOCK_N>(s_ds, dp, GS::row0(), GS::col0());
        else
            store_fragment<BF16, GS::MT, GS::NT, BLOCK_N>(s_ds, dp, 1.f, GS::row0(), GS::col0());
        __syncthreads();  // P and dS are complete

        // dV += P^T dO and dK += dS^T Q: the A operands are read transposed out of the P and dS tiles.
        warp_gemm<BF16, GKV::MT, GKV::NT, BLOCK_M, BLOCK_N, false, HEADDIM, false, kXorLast>(acc_dv, s_p, GKV::row0(),
                                                                                             sdo, GKV::col0());
        warp_gemm<BF16, GKV::MT, GKV::NT, BLOCK_M, BLOCK_N, false, HEADDIM, false, kXorLast>(acc_dk, s_ds, GKV::row0(),
                                                                                             sq, GKV::col0());
        if (STAGES == 1) {
            __syncthreads();  // Q and dO are free: fetch the next block while dQ is computed
            if (step + 1 < steps) load_step(next_head, next_row0, 0);
            cp_async_commit();
        }

        // dQ += dS K, added to dq_accum by reductions. Each reduction adds an 8 x 8 piece of the
        // fragment: 256 contiguous bytes of dq_accum, at a constant offset from the lane's first
        // element (dq_accum rows are HEADDIM == headdim_padded wide). Wide warp tiles are done in two
        // column halves, so only half of dQ's fragment is live at once.
        float* dq_lane = p.dq_accum + dq_accum_index(seq.padded_row0(p, batch, head) + row0 + GQ::row0()
                                                     + fragment_row(0, 0), GQ::col0() + fragment_col(0, 0), HEADDIM);
        const bool all_rows = row0 + BLOCK_M <= seq.seqlen_q;
        int* semaphore = nullptr;  // DETERMINISTIC: this query block's, held for this key block's turn
        if constexpr (DETERMINISTIC)
            semaphore = wait_dq_turn(p, batch, head, row0 / BLOCK_M,
                                     n_block - key_blocks_seen<LOCAL>(p, seq, row0, BLOCK_M, BLOCK_N).first);
        constexpr int kChunkNT = GQ::NT > 4 && GQ::NT % 2 == 0 ? GQ::NT / 2 : GQ::NT;
#pragma unroll
        for (int chunk = 0; chunk < GQ::NT / kChunkNT; ++chunk) {
            float dq[GQ::MT][kChunkNT][4];
            zero(dq);
            warp_gemm<BF16, GQ::MT, kChunkNT, BLOCK_N, BLOCK_N, true, HEADDIM, false>(dq, s_ds, GQ::row0(), s_k,
                                                                                      GQ::col0() + 8 * kChunkNT * chunk);
#pragma unroll
            for (int mt = 0; mt < GQ::MT; ++mt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    if (all_rows || row0 + GQ::row0() + fragment_row(mt, 2 * half) < seq.seqlen_q) {
#pragma unroll
                        for (int nt = 0; nt < kChunkNT; ++nt)
                            atomic_add_pair(dq_lane + (16 * mt + 8 * half) * HEADDIM + 64 * (kChunkNT * chunk + nt),
                                            dq[mt][nt][2 * half], dq[mt][nt][2 * half + 1]);
                    }
                }
        }
        if constexpr (DETERMINISTIC) pass_dq_turn(semaphore);
        head = next_head;
        row0 = next_row0;
    }

    if (kMaySplit && tail.unit >= 0 && !tail.gather(p, acc_dk, acc_dv, BLOCK_N * HEADDIM)) return;

    // dK and dV leave through the K and V tiles for 16-byte coalesced stores.
    cp_async_wait<0>();
    __syncthreads();
    store_fragment<BF16, GKV::MT, GKV::NT, HEADDIM>(s_k, acc_dk, p.softmax_scale, GKV::row0(), GKV::col0());
    store_fragment<BF16, GKV::MT, GKV::NT, HEADDIM>(s_v, acc_dv, 1.f, GKV::row0(), GKV::col0());
    __syncthreads();
    uint16* dk = static_cast<uint16*>(p.dk) + batch * p.dk_batch_stride + head_k * p.dk_head_stride
                 + (seq.first_row_k + key0) * p.dk_row_stride;
    uint16* dv = static_cast<uint16*>(p.dv) + batch * p.dv_batch_stride + head_k * p.dv_head_stride
                 + (seq.first_row_k + key0) * p.dv_row_stride;
    store_tile<BLOCK_N, HEADDIM, T::kThreads, !EVEN_K>(dk, s_k, p.dk_row_stride, seq.seqlen_k - key0, p.headdim);
    store_tile<BLOCK_N, HEADDIM, T::kThreads, !EVEN_K>(dv, s_v, p.dv_row_stride, seq.seqlen_k - key0, p.headdim);
}

// D = rowsum(dO * O) and lse in base 2 per row; zeroes the rows' dq_accum (p.dq_stored_by_bwd: their
// dq, which the sm90 backward's steps overwrite but where a row sees no key block).
template <bool BF16>
__device__ __forceinline__ void flash_bwd_dot(const FlashParams& p) {
    const RowKernel rk(p);
    const int head = blockIdx.y, batch = blockIdx.z;
    const Sequence seq(p, batch);
    if (rk.row0 >= seq.seqlen_q) return;
    const uint16* dout = static_cast<const uint16*>(p.dout) + batch * p.dout_batch_stride + head * p.dout_head_stride
                         + seq.first_row_q * p.dout_row_stride + rk.col();
    const uint16* out = static_cast<const uint16*>(p.out) + batch * p.out_batch_stride + head * p.out_head_stride
                        + seq.first_row_q * p.out_row_stride + rk.col();
    const long long stats_row0 = seq.stats_row0(p, batch, head);
    const long long padded_row0 = seq.padded_row0(p, batch, head, p.dq_accum_fragment_rows != 0);
    uint16* dq = static_cast<uint16*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride
                 + seq.first_row_q * p.dq_row_stride + rk.col();
    for (int row = rk.first_row(); row < rk.row0 + RowKernel::kRows; row += rk.rows_per_step()) {
        float dot = 0.f;
        if (row < seq.seqlen_q && rk.col() < p.headdim) {
            if (p.dq_stored_by_bwd) *reinterpret_cast<uint4*>(dq + row * p.dq_row_stride) = make_uint4(0, 0, 0, 0);
            const uint4 a = *reinterpret_cast<const uint4*>(dout + row * p.dout_row_stride);
            const uint4 b = *reinterpret_cast<const uint4*>(out + row * p.out_row_stride);
            const uint32 wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
                dot += to_float<BF16>(wa[i] & 0xffff) * to_float<BF16>(wb[i] & 0xffff)
                       + to_float<BF16>(wa[i] >> 16) * to_float<BF16>(wb[i] >> 16);
        }
        for (int offset = rk.lanes / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        // Rows past the sequence's end (up to the block's, within its padded rows) get D = 0 and
        // lse_log2 = +inf: their P is 0, whatever a kernel reads for their Q and dO.
        if (rk.col() == 0) {
            const float lse = row < seq.seqlen_q ? p.lse[stats_row0 + row] : -CUPYFLASH_INF;
            p.dout_dot_out[padded_row0 + row] = row < seq.seqlen_q ? dot : 0.f;
            p.lse_log2[padded_row0 + row] = lse == -CUPYFLASH_INF ? CUPYFLASH_INF : lse * CUPYFLASH_LOG2E;
        }
    }
    // dq_accum stores 8 rows together, so the block's rows (rounded up to 8) are one contiguous range.
    // In blocks of p.dq_accum_fragment_rows (dq_accum_fragment_index) any float of the sequence's
    // last block may hold one of its rows: the last row block zeroes through that block's end.
    if (p.dq_stored_by_bwd) return;
    const int unit = p.dq_accum_fragment_rows != 0 ? p.dq_accum_fragment_rows : 8;
    const int rows = (rk.row0 + RowKernel::kRows < seq.seqlen_q ? rk.row0 + RowKernel::kRows
                                                                  : ceil_div(seq.seqlen_q, unit) * unit) - rk.row0;
    float4* accum = reinterpret_cast<float4*>(p.dq_accum + (padded_row0 + rk.row0) * p.headdim_padded);
    for (int i = threadIdx.x; i < rows * p.headdim_padded / 4; i += RowKernel::kThreads)
        accum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// dQ = dq_accum * softmax_scale, in the input's dtype.
template <bool BF16>
__device__ __forceinline__ void flash_bwd_convert_dq(const FlashParams& p) {
    const RowKernel rk(p);
    const int head = blockIdx.y, batch = blockIdx.z;
    const Sequence seq(p, batch);
    if (rk.col() >= p.headdim) return;
    const long long accum_row0 = seq.padded_row0(p, batch, head, p.dq_accum_fragment_rows != 0);
    uint16* dq = static_cast<uint16*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride
                 + seq.first_row_q * p.dq_row_stride + rk.col();
    const int row_end = min(rk.row0 + RowKernel::kRows, seq.seqlen_q);
    const int block_rows = p.dq_accum_fragment_rows;
    for (int row = rk.first_row(); row < row_end; row += rk.rows_per_step()) {
        float4 lo, hi;
        if (block_rows != 0) {  // the 8 floats of the chunk, 16 floats apart (dq_accum_fragment_index)
            const int block = row / block_rows, r = row - block * block_rows;
            const float* v = p.dq_accum + (accum_row0 + block * block_rows) * p.headdim_padded
                             + dq_accum_fragment_index(r, rk.col(), block_rows);
            lo = make_float4(v[0], v[16], v[32], v[48]);
            hi = make_float4(v[64], v[80], v[96], v[112]);
        } else {
            const float4* chunk = reinterpret_cast<const float4*>(p.dq_accum + dq_accum_index(accum_row0 + row, rk.col(), p.headdim_padded));
            lo = chunk[0];
            hi = chunk[1];
        }
        const float c = p.softmax_scale;
        *reinterpret_cast<uint4*>(dq + row * p.dq_row_stride) =
            make_uint4(pack_pair<BF16>(lo.x * c, lo.y * c), pack_pair<BF16>(lo.z * c, lo.w * c),
                       pack_pair<BF16>(hi.x * c, hi.y * c), pack_pair<BF16>(hi.z * c, hi.w * c));
    }
}
