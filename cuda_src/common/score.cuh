// The score options: modifiers of the scores (softcap, ALiBi, an additive bias) and dropout of the
// probabilities. The modifiers make the reference's transform (cupyflash/reference/_common.py, scaled_scores)
//     x = s * scale;   x = softcap * tanh(x / softcap);   x += alibi + attn_bias
// on the raw score s = q . k itself, as x / scale: the kernels fold the scale into exp2 later.
//
// Each modifier is one functor, built per (batch, head): on() says whether the call's parameters
// turn it on, and apply(s, row, col, grad) returns the modified score and multiplies grad by
// d(result)/d(s). The forward and the backward both call apply (the forward drops grad, which costs
// it nothing), so a new modifier is one FlashParams field, one functor here, its bit in namespace
// feature and its place in ScoreMods::for_each.
#pragma once
#include "fragment.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "ptx.cuh"

// The score options a kernel is compiled for, one bit each (cupyflash/_kernels.py writes a kernel's
// FEATURES by these names): a kernel holds only the code of the options its calls use, so each
// option costs its own arithmetic and nothing for the others. A feature compiled in is still
// switched by its parameters (on(), dropout_scale): one uniform branch, which also bounds ptxas's
// schedule (straight-line, the hd128 kernels with every feature spill).
namespace feature {
constexpr int softcap = 1, alibi = 2, bias = 4, dropout = 8;
}

// tanh on the special-function unit: one MUFU op (relative error about 2^-11, fp16's rounding;
// the suite's 2x and 3x rules hold with it), where 1 - 2 / (e^2x + 1) takes two; the forward's
// softmax needs the same unit for its exponentials, so each op there costs time.
__device__ __forceinline__ float fast_tanh(float x) {
    float t;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(x));
    return t;
}

// softcap: s becomes softcap_outer * tanh(s * softcap_inner), with d/ds = 1 - tanh^2 (the
// outer and inner factors cancel). Its factors stay in the parameter block, where instructions
// read them as constant operands, costing no registers.
struct Softcap {
    const FlashParams& p;
    __device__ __forceinline__ Softcap(const FlashParams& params, const Sequence&, int, int) : p(params) {}
    __device__ __forceinline__ bool on() const { return p.softcap_inner != 0.f; }
    __device__ __forceinline__ float apply(float s, int, int, float& grad) const {
        return p.softcap_outer * tanh_part(s, grad);
    }
    // The score in units of softcap_outer, where a pass folds that factor into the exps' scale
    // (score_unit below); the second form also multiplies grad by d/ds.
    __device__ __forceinline__ float tanh_part(float s) const { return fast_tanh(s * p.softcap_inner); }
    __device__ __forceinline__ float tanh_part(float s, float& grad) const {
        const float t = tanh_part(s);
        grad *= 1.f - t * t;
        return t;
    }
};

// A forward whose only score modifier is softcap keeps its scores as tanh(s * softcap_inner) and
// multiplies the softmax's scale by softcap_outer instead (common/online_softmax.cuh takes the
// scores' unit): a multiply fewer per element. Other modifiers add to the capped score, so with
// them the forward applies softcap whole. The unit is 1 where nothing folds.
template <int FEATURES>
__device__ __forceinline__ constexpr bool softcap_folds() {
    return (FEATURES & (feature::softcap | feature::alibi | feature::bias)) == feature::softcap;
}
template <int FEATURES>
__device__ __forceinline__ float score_unit(const FlashParams& p) {
    return softcap_folds<FEATURES>() && p.softcap_inner != 0.f ? p.softcap_outer : 1.f;
}
// Folded, the scores are tanh values t in [-1, 1], so the forward's softmax can subtract a fixed
// maximum instead of a running one: no row maxima, no corrections, no rescale of O. Its exponents
// are (t - bound) * span, span = softcap * log2(e); the bound keeps them in [-120, 40]: 2^-120 is
// a normal float32 and bfloat16, so no probability is flushed or coarsened, and 2^40 leaves O's
// float32 sums room. 1 (P at most 1) up to a span of 60, lower up to 80 (softcap about 55); past
// that, and for float16 P (normal down to 2^-14 only), 0: the running maximum.
template <int FEATURES, bool BF16>
__device__ __forceinline__ float score_bound(const FlashParams& p) {
    if constexpr (softcap_folds<FEATURES>() && BF16) {
        const float span = p.softcap_outer * p.scale_log2;
        if (p.softcap_inner != 0.f && span <= 80.f) return span <= 60.f ? 1.f : __fdividef(120.f, span) - 1.f;
    }
    return 0.f;
}

// 0 <= n < 2^23 as a float, on the full-rate integer and FMA pipes: n added to the bits of 2^23,
// whose last mantissa bit is worth 1, minus 2^23. An int-to-float conversion runs at the
// special-function unit's rate, which the forward's exponentials already fill. (ALiBi calls keep
// seqlen_q + seqlen_k within 2^23: cupyflash/options.py, ALIBI_MAX_TOKENS.)
__device__ __forceinline__ float small_int_to_float(int n) {
    return __int_as_float(0x4B000000 + n) - 8388608.f;
}

// ALiBi: s - slope / scale * |col - diagonal(row)|; d/ds = 1.
struct Alibi {
    const Sequence& seq;
    float slope;  // ALiBi slope / softmax_scale (raw units), 0 without ALiBi
    __device__ __forceinline__ Alibi(const FlashParams& p, const Sequence& sequence, int batch, int head) : seq(sequence) {
        slope = p.alibi_slopes != nullptr ? p.alibi_slopes[batch * p.alibi_batch_stride + head] * p.inv_softmax_scale
                                          : 0.f;
    }
    __device__ __forceinline__ bool on() const { return slope != 0.f; }
    __device__ __forceinline__ float apply(float s, int row, int col, float&) const {
        return fmaf(-slope, small_int_to_float(abs(col - seq.diagonal(row))), s);
    }
};

// attn_bias: s + bias[row][col] / scale; d/ds = 1. The bias is fp32 or the inputs' 16-bit type;
// rows and columns past the sequence are never read. A 16-bit bias whose rows start on 4-byte
// boundaries can be read as words (added_as_words), where the forward does so. Off where the
// kernel has it `in_tiles` instead (sm90's with bias tiles, through the bias's tensor map).
template <bool BF16>
struct Bias {
    const FlashParams& p;
    const Sequence& seq;
    const void* matrix;  // this (batch, head)'s bias, or null
    __device__ __forceinline__ Bias(const FlashParams& params, const Sequence& sequence, int batch, int head,
                                    bool in_tiles = false)
        : p(params), seq(sequence), matrix(nullptr) {
        if (p.attn_bias != nullptr && !in_tiles)
            matrix = advanced(p.attn_bias, batch * p.bias_batch_stride + head * p.bias_head_stride);
    }
    __device__ __forceinline__ bool on() const { return matrix != nullptr; }
    // (row, head, batch) of a (batch, head)'s rows from row0 in the bias's tensor map
    // (sm90/fwd.cuh), whose broadcast dimensions have size 1.
    static __device__ __forceinline__ int3 map_coordinates(const FlashParams& p, int batch, int head, int row0) {
        return make_int3(p.bias_row_stride != 0 ? row0 : 0, p.bias_head_stride != 0 ? head : 0,
                         p.bias_batch_stride != 0 ? batch : 0);
    }
    // `base` moved on by n elements of the bias's dtype.
    __device__ __forceinline__ const void* advanced(const void* base, long long n) const {
        return p.bias_is_float32 ? static_cast<const void*>(static_cast<const float*>(base) + n)
                                 : static_cast<const void*>(static_cast<const uint16*>(base) + n);
    }
    // (A method, not a member set above: kernels that never read words then hold nothing for it.)
    __device__ __forceinline__ bool in_words() const {
        return on() && !p.bias_is_float32
               && ((reinterpret_cast<unsigned long long>(matrix) | 2 * p.bias_row_stride) & 3) == 0;
    }
    // Asks L1 for a tile of the bias (ROWS rows from row0 by COLS columns from col0, a 128-byte
    // piece per thread of THREADS and turn), so that the reads of apply wait on L1, not on DRAM:
    // issued before the products whose scores they join.
    template <int ROWS, int COLS, int THREADS = 128>
    __device__ __forceinline__ void prefetch(int row0, int col0) const {
        if (!on() || seq.seqlen_q == 0) return;
        const int columns_per_piece = p.bias_is_float32 ? 32 : 64, pieces = (COLS + columns_per_piece - 1) / columns_per_piece;
        for (int i = threadIdx.x % THREADS; i < ROWS * pieces; i += THREADS) {
            const int row = min(row0 + i / pieces, seq.seqlen_q - 1), col = col0 + i % pieces * columns_per_piece;
            if (col < seq.seqlen_k)
                asm volatile("prefetch.global.L1 [%0];\n" :: "l"(advanced(matrix, row * p.bias_row_stride + col)));
        }
    }
    __device__ __forceinline__ float apply(float s, int row, int col, float&) const {
        if (row < seq.seqlen_q && col < seq.seqlen_k) {
            const long long at = row * p.bias_row_stride + col;
            const float bias = p.bias_is_float32 ? static_cast<const float*>(matrix)[at]
                                                 : to_float<BF16>(static_cast<const uint16*>(matrix)[at]);
            s = fmaf(bias, p.inv_softmax_scale, s);
        }
        return s;
    }
};

// ALiBi over a warp's fragment tile at (row0, col0), where apply would convert each element's
// distance to the diagonal: a row's distance at its first column is converted once, and each
// element's is that plus its column offset (8 nt + j, a constant), exact below 2^24, so an element
// costs an add and an FMA (|x| an operand modifier). Returns false for the other modifiers.
template <int MT, int NT, typename Mod>
__device__ __forceinline__ bool added_by_rows(float (&)[MT][NT][4], const Mod&, int, int) { return false; }
template <int MT, int NT>
__device__ __forceinline__ bool added_by_rows(float (&s)[MT][NT][4], const Alibi& alibi, int row0, int col0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + fragment_row(mt, 2 * half);
            const float distance0 = static_cast<float>(col0 + fragment_col(0, 0) - alibi.seq.diagonal(row));
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    s[mt][nt][2 * half + j] = fmaf(-alibi.slope, fabsf(distance0 + static_cast<float>(8 * nt + j)),
                                                   s[mt][nt][2 * half + j]);
        }
    return true;
}

// A term of each row's scores that a forward leaves to its softmax (raw units, one value per thread
// and row): added to the thread's part of the block's row maximum and to the exponent's offset
// (common/online_softmax.cuh) instead of to every element. ALiBi leaves one (alibi_by_columns);
// NoRowShift is the other kernels'.
template <int MT>
struct RowShift {
    static constexpr bool kOn = true;
    float value[MT][2];
};
// The RowShift of a forward whose scores' product may bring ALiBi's column terms (sm90/fwd.cuh,
// AlibiProducts): where it did (alibi_added), value holds ALiBi's row terms, and alibi_by_columns
// has nothing left to do.
template <int MT>
struct AlibiAddedShift : RowShift<MT> {
    bool alibi_added = false;
};
struct NoRowShift {
    static constexpr bool kOn = false;
};
template <int MT, bool ALIBI, bool ALIBI_PRODUCTS = false>
struct RowShiftFor {  // the shift a forward keeps per key block
    typedef NoRowShift type;
};
template <int MT>
struct RowShiftFor<MT, true, false> {
    typedef RowShift<MT> type;
};
template <int MT>
struct RowShiftFor<MT, true, true> {
    typedef AlibiAddedShift<MT> type;
};

// ALiBi over a warp's fragment tile at (row0, col0) whose keys all sit on one side of each row's
// diagonal, as under a causal mask every block but the diagonal's: there -slope |col - diagonal(row)|
// is k (col - diagonal(row)), k = slope left of it and -slope right, which splits into k (8 nt + j),
// a constant per element (one FFMA), and k (the thread's first column - diagonal(row)), left in
// `shift` (per thread: its quad's columns differ). Returns false, touching nothing, where a row's
// diagonal falls inside the tile.
template <int MT, int NT, typename Mod, typename Shift>
__device__ __forceinline__ bool alibi_by_columns(float (&)[MT][NT][4], const Mod&, int, int, Shift&) { return false; }
template <int MT, int NT>
__device__ __forceinline__ bool alibi_by_columns(float (&s)[MT][NT][4], const Alibi& alibi, int row0, int col0,
                                                 RowShift<MT>& shift) {
    float k;
    if (col0 + 8 * NT - 1 <= alibi.seq.diagonal(row0)) k = alibi.slope;
    else if (col0 >= alibi.seq.diagonal(row0 + 16 * MT - 1)) k = -alibi.slope;
    else return false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + fragment_row(mt, 2 * half);
            shift.value[mt][half] = k * static_cast<float>(col0 + fragment_col(0, 0) - alibi.seq.diagonal(row));
        }
    for_each_element<MT, NT>([&](int mt, int nt, int e) {
        s[mt][nt][e] = fmaf(k, static_cast<float>(8 * nt + e % 2), s[mt][nt][e]);
    });
    return true;
}
template <int MT, int NT>
__device__ __forceinline__ bool alibi_by_columns(float (&s)[MT][NT][4], const Alibi& alibi, int row0, int col0,
                                                 AlibiAddedShift<MT>& shift) {
    return shift.alibi_added || alibi_by_columns(s, alibi, row0, col0, static_cast<RowShift<MT>&>(shift));
}

// A forward's modifier read as words where it can be (only a bias in_words): adds it to a warp's
// fragment tile at (row0, col0), one word per two neighbouring columns, and returns true; else
// returns false and leaves it to apply. The loads are issued first, then joined to the scores.
// Rows past the sequence read its last row (their results are never stored); columns past it read
// nothing.
template <int MT, int NT, typename Mod>
__device__ __forceinline__ bool added_as_words(float (&)[MT][NT][4], const Mod&, int, int) { return false; }
template <int MT, int NT, bool BF16>
__device__ __forceinline__ bool added_as_words(float (&s)[MT][NT][4], const Bias<BF16>& bias, int row0, int col0) {
    if (!bias.in_words()) return false;
    uint32 words[MT][2][NT];  // [row half][tile]: columns 8 nt + 2 t and the next, low half first
    const bool whole = col0 + 8 * NT <= bias.seq.seqlen_k;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = min(row0 + fragment_row(mt, 2 * half), bias.seq.seqlen_q - 1);
            const uint16* at = static_cast<const uint16*>(bias.matrix) + row * bias.p.bias_row_stride + col0;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = fragment_col(nt, 0);
                const int left = bias.seq.seqlen_k - col0 - col;  // columns from this one to the end
                words[mt][half][nt] = whole || left >= 2 ? __ldg(reinterpret_cast<const uint32*>(at + col))
                                      : left == 1        ? static_cast<uint32>(__ldg(at + col))
                                                         : 0u;
            }
        }
    for_each_element<MT, NT>([&](int mt, int nt, int e) {
        const uint32 word = words[mt][e / 2][nt];
        const float b = to_float<BF16>(static_cast<uint16>(e % 2 ? word >> 16 : word));
        s[mt][nt][e] = fmaf(b, bias.p.inv_softmax_scale, s[mt][nt][e]);
    });
    return true;
}

// dbias of a (batch, head), where the call asks for it. A bias that is not broadcast gets its
// gradient in its own dtype, one writer per element, stored; otherwise dS goes to an fp32 matrix,
// stored where it has a matrix per (batch, head) (a deterministic call's, or one whose bias is
// broadcast over the rows alone), else (a zero batch or head stride, and the row stride 0 where the
// rows are broadcast too) added by atomics, and the host sums it over the broadcast dimensions.
template <bool BF16>
struct BiasGradient {
    void* matrix;  // null where the call returns no dbias
    long long row_stride;
    bool shared, fp32;
    __device__ __forceinline__ BiasGradient(const FlashParams& p, int batch, int head)
        : matrix(p.dbias), row_stride(p.dbias_row_stride),
          shared(p.dbias_batch_stride == 0 || p.dbias_head_stride == 0), fp32(p.dbias_is_float32 != 0) {
        const long long offset = batch * p.dbias_batch_stride + head * p.dbias_head_stride;
        if (matrix != nullptr)
            matrix = fp32 ? static_cast<void*>(static_cast<float*>(matrix) + offset)
                          : static_cast<void*>(static_cast<uint16*>(matrix) + offset);
    }
    __device__ __forceinline__ void add(int row, int col, float ds) const {
        const long long at = row * row_stride + col;
        if (!fp32) static_cast<uint16*>(matrix)[at] = to_16bit<BF16>(ds);
        else if (shared) atomicAdd(static_cast<float*>(matrix) + at, ds);
        else static_cast<float*>(matrix)[at] = ds;
    }
};

// The modifiers of a (batch, head) that FEATURES compiles in, in the order they apply.
template <bool BF16, int FEATURES>
struct ScoreMods {
    Softcap softcap;
    Alibi alibi;
    Bias<BF16> bias;

    __device__ __forceinline__ ScoreMods(const FlashParams& p, const Sequence& seq, int batch, int head,
                                         bool bias_in_tiles = false)
        : softcap(p, seq, batch, head), alibi(p, seq, batch, head), bias(p, seq, batch, head, bias_in_tiles) {}

    // Calls f(modifier) for each modifier compiled in and on, in order.
    template <typename F>
    __device__ __forceinline__ void for_each(F f) const {
        if constexpr ((FEATURES & feature::softcap) != 0) if (softcap.on()) f(softcap);
        if constexpr ((FEATURES & feature::alibi) != 0) if (alibi.on()) f(alibi);
        if constexpr ((FEATURES & feature::bias) != 0) if (bias.on()) f(bias);
    }

    // The modified score at (row, col); grad is multiplied by d(result)/d(s).
    __device__ __forceinline__ float apply(float s, int row, int col, float& grad) const {
        for_each([&](const auto& mod) { s = mod.apply(s, row, col, grad); });
        return s;
    }
};

// Philox4x32-10 (Salmon et al., SC 2011): four random 32-bit words from a 128-bit counter and a
// 64-bit key. cupyflash/reference/philox.py implements the same function in NumPy.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned long long seed) {
    uint32 k0 = static_cast<uint32>(seed), k1 = static_cast<uint32>(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        // Each product's halves by one 32 x 32 -> 64-bit multiply (IMAD.WIDE.U32) in PTX: written
        // in C++, the front end merged the halves' XORs into 64-bit operations, which ptxas then
        // multiplied as 64-bit integers (three IMADs each).
        uint32 lo0, hi0, lo1, hi1;
        asm("{\n\t.reg .b64 m;\n\tmul.wide.u32 m, %2, 0xD2511F53;\n\tmov.b64 {%0, %1}, m;\n\t}\n"
            : "=r"(lo0), "=r"(hi0) : "r"(c.x));
        asm("{\n\t.reg .b64 m;\n\tmul.wide.u32 m, %2, 0xCD9E8D57;\n\tmov.b64 {%0, %1}, m;\n\t}\n"
            : "=r"(lo1), "=r"(hi1) : "r"(c.z));
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

// Dropout draws kDropoutBits = 8 random bits per element, so one Philox call decides a group of 16
// elements: the rows and columns that agree but in their bits 0 and 3. The counter is (column with
// bits 0 and 3 clear, row with bits 0 and 3 clear, batch * nheads + head, 0); element (i, j) takes
// byte 2 (i bit 3) + (j bit 3) of word 2 (i bit 0) + (j bit 0) and is kept iff that byte is below
// the keep count k, that is iff the word shifted left to put it on top is at most
// p.dropout_keep_max = k * 2^24 - 1. cupyflash/reference/philox.py draws the same bits.
// In an accumulator fragment a group spans two lanes four apart (rows i and i ^ 1 in the m16n8
// layout; keys j and j ^ 1 in the backward's transposed one), so each lane of the pair draws one of
// two groups and they trade the two words the other needs: a call per 16 of a lane's elements.
constexpr int kDropoutBits = 8;

// The two words of a call that a lane whose bit-0 coordinate (the row's, ROW_PARITY; else the
// column's) is `parity` uses: {its elements of bit-0 coordinate 0 of the other axis, of 1}.
template <bool ROW_PARITY>
__device__ __forceinline__ uint2 dropout_words_of(uint4 r, int parity) {
    if constexpr (ROW_PARITY) return parity ? make_uint2(r.z, r.w) : make_uint2(r.x, r.y);
    else return parity ? make_uint2(r.y, r.w) : make_uint2(r.x, r.z);
}

// A lane pair's trade: `drawn` is this lane's call (the group of its parity); returns the words
// this lane uses of the pair's group 0 (drawn by parity 0) and group 1.
template <bool ROW_PARITY>
__device__ __forceinline__ void trade_dropout_words(uint4 drawn, int parity, uint2& group0, uint2& group1) {
    const uint2 own = dropout_words_of<ROW_PARITY>(drawn, parity), given = dropout_words_of<ROW_PARITY>(drawn, parity ^ 1);
    const uint2 got = make_uint2(__shfl_xor_sync(0xffffffffu, given.x, 4), __shfl_xor_sync(0xffffffffu, given.y, 4));
    group0 = parity ? got : own;
    group1 = parity ? own : got;
}

// Whether the element at byte `byte` of `word` is kept (see kDropoutBits).
__device__ __forceinline__ bool dropout_kept(uint32 word, int byte, uint32 keep_max) {
    return word << (32 - kDropoutBits * (byte + 1)) <= keep_max;
}

// Dropout's Philox key: the call's seed, or read on the device (where a graph replay must see a new one).
__device__ __forceinline__ unsigned long long dropout_seed(const FlashParams& p) {
    return p.dropout_seed_device == nullptr ? static_cast<unsigned long long>(p.dropout_seed)
                                            : __ldg(static_cast<const unsigned long long*>(p.dropout_seed_device));
}

// f(mt, kk, words) for each group of a warp's fragment tile at (row0, col0): m-tile mt, tiles
// 2 kk and 2 kk + 1; words are this lane's (the row's bit 0 is its own), .x for the even columns
// and .y for the odd. row0 is a multiple of 16, and so is col0 unless the warp spans one tile (NT
// 1: half a group, its columns' bit 3 that of col0). Where dropout is off, words of zeros keep
// every element.
template <int MT, int NT, typename F>
__device__ __forceinline__ void for_each_dropout_group(const FlashParams& p, bool on, int batch, int head, int row0,
                                                       int col0, F f) {
    static_assert(NT % 2 == 0 || NT == 1, "a warp's columns are whole groups of 16, or one tile");
    constexpr int kRowGroups = (NT + 1) / 2, kGroups = MT * kRowGroups;  // group q: m-tile q / kRowGroups
    const unsigned long long key = dropout_seed(p);
    const int g = threadIdx.x % 32 / 4, parity = g & 1;
    const auto draw = [&](int q) {
        return on ? philox4x32_10(make_uint4((col0 & ~8) + 16 * (q % kRowGroups) + 2 * (threadIdx.x % 4),
                                             row0 + 16 * (q / kRowGroups) + (g & ~1), batch * p.nheads + head, 0), key)
                  : make_uint4(0, 0, 0, 0);
    };
#pragma unroll
    for (int q = 0; q + 1 < kGroups; q += 2) {
        uint2 group0, group1;
        trade_dropout_words<true>(draw(q + parity), parity, group0, group1);
        f(q / kRowGroups, q % kRowGroups, group0);
        f((q + 1) / kRowGroups, (q + 1) % kRowGroups, group1);
    }
    if constexpr (kGroups % 2 == 1)
        f(MT - 1, kRowGroups - 1, dropout_words_of<true>(draw(kGroups - 1), parity));
}

// f(mt, nt, e, kept) for each element of a warp's fragment tile at (row0, col0) (as for_each_dropout_group).
template <int MT, int NT, typename F>
__device__ __forceinline__ void for_each_dropout_decision(const FlashParams& p, bool on, int batch, int head, int row0,
                                                          int col0, F f) {
    const uint32 keep_max = static_cast<uint32>(p.dropout_keep_max);
    for_each_dropout_group<MT, NT>(p, on, batch, head, row0, col0, [&](int mt, int kk, uint2 words) {
#pragma unroll
        for (int n = 0; n < (NT == 1 ? 1 : 2); ++n) {
            const int column_bit3 = NT == 1 ? (col0 >> 3) & 1 : n;
#pragma unroll
            for (int e = 0; e < 4; ++e)  // (row bit 3, column bit 0) = (e / 2, e % 2)
                f(mt, 2 * kk + n, e, dropout_kept(e % 2 ? words.y : words.x, 2 * (e / 2) + column_bit3, keep_max));
        }
    });
}

// Bit 7 of each byte of the result is set iff that byte of `word` is at least the keep count k,
// that is iff its element is dropped: the carry out of the byte's sum with 256 - k (`complement`,
// in every byte), four bytes at once. The low seven bits' sums cannot carry into the next byte,
// and the carry out of bit 7 is the majority of the two bit 7s and the carry into it.
__device__ __forceinline__ uint32 dropped_bytes(uint32 word, uint32 complement) {
    const uint32 low = (word & 0x7F7F7F7Fu) + (complement & 0x7F7F7F7Fu);
    return (word & complement) | (word & low) | (complement & low);
}

// Dropout on a warp's probabilities packed as the A operand of P V (m16n8k16 order: frag(mt, kk, r)
// holds columns 2t, 2t + 1 of tile 2 kk + r / 2, row g + 8 (r % 2)): dropped elements become 0, by
// a mask per pair of elements. The caller scales the kept ones by p.dropout_scale.
template <int MT, int NT, typename Frag>
__device__ __forceinline__ void apply_dropout_packed(Frag frag, const FlashParams& p, int batch, int head, int row0,
                                                     int col0) {
    static_assert(NT % 2 == 0, "P's registers pair whole groups");
    const uint32 complement = (~static_cast<uint32>(p.dropout_keep_max) >> (32 - kDropoutBits)) * 0x01010101u;
    for_each_dropout_group<MT, NT>(p, true, batch, head, row0, col0, [&](int mt, int kk, uint2 words) {
        const uint32 even = dropped_bytes(words.x, complement), odd = dropped_bytes(words.y, complement);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            // byte 2 (row bit 3) + (column bit 3), its sign spread over 16 bits: from `even` in the
            // low half (the even column's element), from `odd` in the high half
            constexpr uint32 kSelectors[4] = {0xCC88u, 0xEEAAu, 0xDD99u, 0xFFBBu};
            uint32 dropped;
            asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(dropped) : "r"(even), "r"(odd), "r"(kSelectors[r]));
            frag(mt, kk, r) &= ~dropped;
        }
    });
}
