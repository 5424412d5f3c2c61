// The options of the EXTRAS kernels, applied per score element: softcap, ALiBi, an additive
// bias, dropout. The same transform as the reference's (cupyflash/reference.py, scaled_scores):
//     x = s * scale;   x = softcap * tanh(x / softcap);   x += alibi + attn_bias
// The kernels keep scores in raw units (the scale is folded into exp2 later), so the transform
// hands back x / scale.
#pragma once
#include "mask.cuh"

struct ScoreOptions {
    float scale, inv_scale, softcap, inv_softcap, alibi_slope;
    const void* bias;  // this (batch, head)'s bias matrix, or null
    int bias_is_float32;
    long long bias_row_stride;

    __device__ __forceinline__ ScoreOptions(const FlashParams& p, const Sequence& seq, int batch, int head) {
        scale = p.softmax_scale;
        inv_scale = 1.f / p.softmax_scale;
        softcap = p.softcap;
        inv_softcap = p.softcap > 0.f ? 1.f / p.softcap : 0.f;
        alibi_slope = p.alibi_slopes != nullptr ? p.alibi_slopes[batch * p.alibi_batch_stride + head] : 0.f;
        bias_is_float32 = p.bias_is_float32;
        bias_row_stride = p.bias_row_stride;
        bias = nullptr;
        if (p.attn_bias != nullptr) {
            const long long offset = batch * p.bias_batch_stride + head * p.bias_head_stride;
            bias = bias_is_float32 ? static_cast<const void*>(static_cast<const float*>(p.attn_bias) + offset)
                                   : static_cast<const void*>(static_cast<const uint16*>(p.attn_bias) + offset);
        }
    }

    // The transformed score of raw s = q . k at (row, col), in raw units; `slope` receives
    // d(result)/d(s), which softcap makes 1 - tanh^2 (1 without it). Rows and columns past the
    // sequence must not reach the bias, so the caller passes in_bounds.
    template <bool BF16>
    __device__ __forceinline__ float apply(float s, const Sequence& seq, int row, int col, bool in_bounds,
                                           float& slope) const {
        float x = s * scale;
        slope = 1.f;
        if (softcap > 0.f) {
            const float t = tanhf(x * inv_softcap);
            x = softcap * t;
            slope = 1.f - t * t;
        }
        if (alibi_slope != 0.f) x -= alibi_slope * fabsf(static_cast<float>(col - seq.diagonal(row)));
        if (bias != nullptr && in_bounds) {
            const long long at = row * bias_row_stride + col;
            x += bias_is_float32 ? static_cast<const float*>(bias)[at]
                                 : to_float<BF16>(static_cast<const uint16*>(bias)[at]);
        }
        return x * inv_scale;
    }
};

// Philox4x32-10 (Salmon et al., SC 2011): four random 32-bit words from a 128-bit counter and a
// 64-bit key. cupyflash/reference.py implements the same function in NumPy.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned long long seed) {
    uint32 k0 = static_cast<uint32>(seed), k1 = static_cast<uint32>(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const uint32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const uint32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
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
    const unsigned long long below = static_cast<unsigned long long>(p.dropout_keep_below);
    return (r.x < below) | (r.y < below) << 1 | (r.z < below) << 2 | (r.w < below) << 3;
}
