// The one parameter block that every cupyflash kernel receives, by value.
//
// Python builds the same bytes from this very file: cupyflash/_params.py reads the field lines
// below (one field per line, C types `const void*`, `void*`, `float*`, `long long`, `int`,
// `float`; anything else is refused there) into a NumPy structured dtype with C alignment, and
// every compiled source asserts the struct's size against it. A new option is
// one new field here (and, where it changes the code path, one template flag in the kernel).
#pragma once

struct FlashParams {
    // Tensors. q, k, v, out, dout, dq, dk, dv hold 16-bit floats (fp16 or bf16).
    const void* q;
    const void* k;
    const void* v;
    void* out;
    float* lse;            // (batch, nheads, seqlen_q), natural log; -inf for a row that sees no key
    const void* dout;
    void* dq;
    void* dk;
    void* dv;
    float* dq_accum;       // (batch, nheads, seqlen_q, headdim_padded), fp32, zeroed before the backward
    float* dout_dot_out;   // (batch, nheads, seqlen_q): D = rowsum(dout * out), fp32
    float* lse_log2;       // (batch, nheads, seqlen_q): lse * log2(e), +inf for a row that sees no key

    // Strides in elements. The last dimension (headdim) is always contiguous.
    long long q_batch_stride;
    long long q_row_stride;
    long long q_head_stride;
    long long k_batch_stride;
    long long k_row_stride;
    long long k_head_stride;
    long long v_batch_stride;
    long long v_row_stride;
    long long v_head_stride;
    long long out_batch_stride;
    long long out_row_stride;
    long long out_head_stride;
    long long dout_batch_stride;
    long long dout_row_stride;
    long long dout_head_stride;
    long long dq_batch_stride;
    long long dq_row_stride;
    long long dq_head_stride;
    long long dk_batch_stride;
    long long dk_row_stride;
    long long dk_head_stride;
    long long dv_batch_stride;
    long long dv_row_stride;
    long long dv_head_stride;

    // Sizes.
    int batch;
    int nheads;
    int nheads_k;
    int seqlen_q;
    int seqlen_k;
    int headdim;           // the caller's head dim, a multiple of 8
    int headdim_padded;    // the kernel's head dim (the tile's), >= headdim

    // Softmax scale, and the same times log2(e) so the kernels can use exp2.
    float softmax_scale;
    float scale_log2;
};
