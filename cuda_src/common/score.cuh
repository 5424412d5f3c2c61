// The options of the EXTRAS kernels, applied per score element: softcap, ALiBi, an additive
// bias, dropout. The same transform as the reference's (cupyflash/reference.py, scaled_scores):
//     x = s * scale;   x = softcap * tanh(x / softcap);   x += alibi + attn_bias
// The kernels keep scores in raw units (the scale is folded into exp2 later), so this is done
// as x / scale, on s directly.
#pragma once
#include "mask.cuh"
#include "../sm80/tile.cuh"

// tanh(x) = 1 - 2 / (e^2x + 1): two MUFU ops (ex2, rcp) and three FMA-class ops, within ~1e-7
// absolute of tanh (the libdevice tanhf costs about five times as many instructions).
__device__ __forceinline__ float fast_tanh(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(fast_exp2(x * 2.8853900817779268f) + 1.f));  // 2 log2(e)
    return fmaf(-2.f, r, 1.f);
}

// Per (batch, head): the ALiBi slope and the bias matrix. The rest of the options stay in the
// parameter block, where instructions read them as constant operands, costing no registers.
struct ScoreOptions {
    const FlashParams& p;
    float alibi_raw;   // ALiBi slope / softmax_scale (raw units), 0 without ALiBi
    const void* bias;  // this (batch, head)'s bias matrix, or null

    __device__ __forceinline__ ScoreOptions(const FlashParams& params, int batch, int head) : p(params) {
        alibi_raw = p.alibi_slopes != nullptr ? p.alibi_slopes[batch * p.alibi_batch_stride + head] * p.inv_softmax_scale
                                              : 0.f;
        bias = nullptr;
        if (p.attn_bias != nullptr) {
            const long long offset = batch * p.bias_batch_stride + head * p.bias_head_stride;
            bias = p.bias_is_float32 ? static_cast<const void*>(static_cast<const float*>(p.attn_bias) + offset)
                                     : static_cast<const void*>(static_cast<const uint16*>(p.attn_bias) + offset);
        }
    }

    template <bool BF16>
    __device__ __forceinline__ float bias_at(int row, int col) const {
        const long long at = row * p.bias_row_stride + col;
        return p.bias_is_float32 ? static_cast<const float*>(bias)[at] : to_float<BF16>(static_cast<const uint16*>(bias)[at]);
    }

    // The transformed raw score s = q . k at (row, col), in raw units; `slope` receives
    // d(result)/d(s), which softcap makes 1 - tanh^2 (1 without it). Rows and columns past the
    // sequence must not reach the bias, so the caller passes in_bounds.
    template <bool BF16>
    __device__ __forceinline__ float apply(float s, const Sequence& seq, int row, int col, bool in_bounds,
                                           float& slope) const {
        slope = 1.f;
        if (p.softcap_inner != 0.f) {
            const float t = fast_tanh(s * p.softcap_inner);
            s = p.softcap_outer * t;
            slope = 1.f - t * t;
        }
        s = fmaf(-alibi_raw, static_cast<float>(abs(col - seq.diagonal(row))), s);
        if (bias != nullptr && in_bounds) s = fmaf(bias_at<BF16>(row, col), p.inv_softmax_scale, s);
        return s;
    }

    // The same transform over a warp's whole S fragment (tile at row0, col0), one option at a time:
    // each pass is a branch-free unrolled loop, where per-element branches would stall the schedule.
    template <bool BF16, int MT, int NT>
    __device__ __forceinline__ void apply(float (&s)[MT][NT][4], const Sequence& seq, int row0, int col0) const {
        if (p.softcap_inner != 0.f) {
            for_each_element<MT, NT>([&](int mt, int nt, int e) {
                s[mt][nt][e] = p.softcap_outer * fast_tanh(s[mt][nt][e] * p.softcap_inner);
            });
        }
        if (alibi_raw != 0.f) {
            for_each_element<MT, NT>([&](int mt, int nt, int e) {
                const int distance = abs(col0 + fragment_col(nt, e) - seq.diagonal(row0 + fragment_row(mt, e)));
                s[mt][nt][e] = fmaf(-alibi_raw, static_cast<float>(distance), s[mt][nt][e]);
            });
        }
        if (bias != nullptr) {
            for_each_element<MT, NT>([&](int mt, int nt, int e) {
                const int row = row0 + fragment_row(mt, e), col = col0 + fragment_col(nt, e);
                if (row < seq.seqlen_q && col < seq.seqlen_k)
                    s[mt][nt][e] = fmaf(bias_at<BF16>(row, col), p.inv_softmax_scale, s[mt][nt][e]);
            });
        }
    }
};

// Philox4x32-10 (Salmon et al., SC 2011): four random 32-bit words from a 128-bit counter and a
// 64-bit key. cupyflash/reference.py implements the same function in NumPy.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned long long seed) {
    uint32 k0 = static_cast<uint32>(seed), k1 = static_cast<uint32>(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        // One 32x32 -> 64-bit multiply (IMAD.WIDE) gives both halves of each product.
        const unsigned long long m0 = 0xD2511F53ull * c.x, m1 = 0xCD9E8D57ull * c.z;
        const uint32 hi0 = static_cast<uint32>(m0 >> 32), lo0 = static_cast<uint32>(m0);
        const uint32 hi1 = static_cast<uint32>(m1 >> 32), lo1 = static_cast<uint32>(m1);
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

// The dropout keep bits of one m16n8 accumulator tile's four elements of this thread: element e
// sits at (row + 8 * (e / 2), col + e % 2), with row % 16 < 8 and col even. One Philox call per
// tile element group, counter (col, row, batch * nheads + head, 0); word e decides element e.
__device__ __forceinline__ uint32 dropout_keep_bits(const FlashParams& p, int batch, int head, int row, int col) {
    const uint4 r = philox4x32_10(make_uint4(col, row, batch * p.nheads + head, 0),
                                  static_cast<unsigned long long>(p.dropout_seed));
    const uint32 below = static_cast<uint32>(p.dropout_keep_below);  // at most 2^32 - 1
    return (r.x < below) | (r.y < below) << 1 | (r.z < below) << 2 | (r.w < below) << 3;
}

// Dropout on a warp's probabilities (tile at row0, col0): dropped elements become 0. The caller
// scales the kept ones by 1 / (1 - dropout_p).
template <int MT, int NT>
__device__ __forceinline__ void apply_dropout(float (&s)[MT][NT][4], const FlashParams& p, int batch, int head,
                                              int row0, int col0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const uint32 keep = dropout_keep_bits(p, batch, head, row0 + fragment_row(mt, 0), col0 + fragment_col(nt, 0));
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!(keep >> e & 1)) s[mt][nt][e] = 0.f;
        }
}
