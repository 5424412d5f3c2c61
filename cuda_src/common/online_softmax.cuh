// The forward's steps on a warp's accumulator fragments (common/fragment.cuh), shared by the
// kernel families: masks, the score options, dropout, the online softmax of one key block, and
// the rows' finish (normalised O, lse).
#pragma once
#include "fragment.cuh"
#include "mask.cuh"
#include "score.cuh"

// Sets the elements of a warp's accumulator fragment (tile origin row0, col0) that their row does
// not see to `hidden`. Per row, the visible keys are a range [lo, hi] relative to the lane's first
// column, so each element costs two compares against compile-time column offsets.
template <bool LOCAL, int MT, int NT>
__device__ __forceinline__ void mask_fragment(float (&s)[MT][NT][4], const FlashParams& p, const Sequence& seq,
                                              int row0, int col0, float hidden) {
    const int lane_col0 = col0 + fragment_col(0, 0);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const KeyOffsets seen = key_offsets_seen<LOCAL>(p, seq, row0 + fragment_row(mt, 2 * half), lane_col0);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    if (8 * nt + j > seen.hi || (LOCAL && 8 * nt + j < seen.lo)) s[mt][nt][2 * half + j] = hidden;
        }
}

// The score modifiers over a warp's S fragment (tile at row0, col0), one modifier at a time: each
// pass is a branch-free unrolled loop, where per-element branches would stall the schedule. ALiBi
// goes by columns where a tile's keys sit on one side of the diagonal, its per-row term left in
// `shift` to the softmax (common/score.cuh, alibi_by_columns; with a RowShift, which the caller
// zeroes), else by rows (added_by_rows); with BIAS_WORDS, a modifier that can be read as words is
// (added_as_words). Softcap alone leaves its outer factor to the softmax's scale (score_unit).
template <bool BIAS_WORDS, int MT, int NT, bool BF16, int FEATURES, typename Shift>
__device__ __forceinline__ void apply_score_mods(float (&s)[MT][NT][4], const ScoreMods<BF16, FEATURES>& mods,
                                                 int row0, int col0, Shift& shift) {
    if constexpr (softcap_folds<FEATURES>()) {
        if (mods.softcap.on())
            for_each_element<MT, NT>([&](int mt, int nt, int e) {
                s[mt][nt][e] = mods.softcap.tanh_part(s[mt][nt][e]);
            });
        return;
    }
    mods.for_each([&](const auto& mod) {
        if (!alibi_by_columns(s, mod, row0, col0, shift) && !added_by_rows(s, mod, row0, col0)
            && !(BIAS_WORDS && added_as_words(s, mod, row0, col0))) {
            for_each_element<MT, NT>([&](int mt, int nt, int e) {
                float grad = 1.f;  // the forward needs no gradient
                s[mt][nt][e] = mod.apply(s[mt][nt][e], row0 + fragment_row(mt, e), col0 + fragment_col(nt, e), grad);
            });
        }
    });
}

// The online softmax of one key block in base 2: s becomes p = 2^(s * scale_log2 - max * scale_log2),
// one FFMA per element, row_sum gains it, and O is rescaled where a row's maximum moved. Scores come
// in units of `unit` (common/score.cuh, score_unit; 1 but where softcap folds), multiplied in
// before scale_log2, so that a unit of 1 leaves the plain kernels' code as it was. It comes
// in three steps (new_row_max, rescale, exponentiate) so that a kernel whose P V product runs
// asynchronously can exponentiate while it runs and rescale O after it; softmax_step does all three.
// A row with nothing visible yet keeps max = -inf; its offset is 0 so every p is 0, not NaN.
// A RowShift (common/score.cuh) adds its rows' terms to the block's maxima and to the exponents.
// A `bound` other than 0 (common/score.cuh, score_bound) is every row's maximum from the start: no
// block maxima, and O is never rescaled.
// A row's maximum moves only when a block's is more than kSlack above it (in the exponent):
// till then p may reach 2^kSlack = 256, harmless in the fp32 sums and in 16-bit P, and O
// keeps its scale. O is rescaled only when a row of the warp moved, rare after the first blocks.
template <int MT>
struct SoftmaxStep {
    float offset[MT][2], correction[MT][2];
    bool max_moved;  // in any row of the warp
};

template <int MT, int NT, typename Shift = NoRowShift>
__device__ __forceinline__ SoftmaxStep<MT> new_row_max(const float (&s)[MT][NT][4], float (&row_max)[MT][2],
                                                       float (&row_sum)[MT][2], const FlashParams& p, float unit,
                                                       const Shift& shift = Shift(), float bound = 0.f) {
    constexpr float kSlack = 8.f;
    SoftmaxStep<MT> step;
    if (bound != 0.f) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                row_max[mt][half] = bound;
                step.offset[mt][half] = bound * unit * p.scale_log2;
                step.correction[mt][half] = 1.f;
            }
        step.max_moved = false;
        return step;
    }
    bool max_moved = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float block_max = -CUPYFLASH_INF;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                block_max = fmaxf(block_max, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
            // (A thread's shift holds its own columns' part: added before the quad's reduction.)
            if constexpr (Shift::kOn) block_max += shift.value[mt][half];
            block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
            block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 2));
            const bool moves = block_max * unit * p.scale_log2 > row_max[mt][half] * unit * p.scale_log2 + kSlack;
            const float new_max = moves ? block_max : row_max[mt][half];
            step.offset[mt][half] = new_max == -CUPYFLASH_INF ? 0.f : new_max * unit * p.scale_log2;
            step.correction[mt][half] =
                moves ? fast_exp2(row_max[mt][half] * unit * p.scale_log2 - step.offset[mt][half]) : 1.f;
            max_moved |= moves;
            row_max[mt][half] = new_max;
            row_sum[mt][half] *= step.correction[mt][half];
        }
    step.max_moved = __any_sync(0xffffffffu, max_moved);
    return step;
}

template <int MT, int DT>
__device__ __forceinline__ void rescale(float (&acc_o)[MT][DT][4], const SoftmaxStep<MT>& step) {
    if (step.max_moved)
        for_each_element<MT, DT>([&](int mt, int dt, int e) { acc_o[mt][dt][e] *= step.correction[mt][e / 2]; });
}

template <int MT, int NT, typename Shift = NoRowShift>
__device__ __forceinline__ void exponentiate(float (&s)[MT][NT][4], float (&row_sum)[MT][2], const SoftmaxStep<MT>& step,
                                             const FlashParams& p, float unit, const Shift& shift = Shift()) {
    for_each_element<MT, NT>([&](int mt, int nt, int e) {
        float offset = -step.offset[mt][e / 2];
        if constexpr (Shift::kOn) offset = fmaf(shift.value[mt][e / 2], p.scale_log2 * unit, offset);
        s[mt][nt][e] = fast_exp2(fmaf(s[mt][nt][e], p.scale_log2 * unit, offset));
        row_sum[mt][e / 2] += s[mt][nt][e];
    });
}

template <int MT, int NT, int DT, typename Shift = NoRowShift>
__device__ __forceinline__ void softmax_step(float (&s)[MT][NT][4], float (&acc_o)[MT][DT][4], float (&row_max)[MT][2],
                                             float (&row_sum)[MT][2], const FlashParams& p, float unit,
                                             const Shift& shift = Shift(), float bound = 0.f) {
    const SoftmaxStep<MT> step = new_row_max(s, row_max, row_sum, p, unit, shift, bound);
    rescale(acc_o, step);
    exponentiate(s, row_sum, step, p, unit, shift);
}

// After the last key block: O divided by each row's sum (times out_scale), and lse[row] written
// for the warp's rows (fragment rows from row0) below seqlen_q. A row's sum is spread over the 4
// threads of its quad. A row that saw no key gets O = 0 and lse = -inf (the log of an empty sum).
template <int MT, int DT>
__device__ __forceinline__ void finish_rows(float (&acc_o)[MT][DT][4], const float (&row_max)[MT][2],
                                            const float (&row_sum)[MT][2], float out_scale, const FlashParams& p,
                                            float unit, float* lse, int row0, int seqlen_q) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float sum = row_sum[mt][half];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float inv_sum = sum > 0.f ? out_scale / sum : 0.f;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                acc_o[mt][dt][2 * half] *= inv_sum;
                acc_o[mt][dt][2 * half + 1] *= inv_sum;
            }
            const int row = row0 + fragment_row(mt, 2 * half);
            if (threadIdx.x % 4 == 0 && row < seqlen_q)
                lse[row] = sum > 0.f ? row_max[mt][half] * unit * p.softmax_scale + logf(sum) : -CUPYFLASH_INF;
        }
}
