// The one parameter block that every cupyflash kernel receives, by value.
//
// Python builds the same bytes from this very file: cupyflash/_params.py reads the field lines
// below (one field per line, C types `const void*`, `void*`, `const float*`, `float*`, `const int*`,
// `int*`, `long long`, `int`, `float`; anything else is refused there) into a NumPy structured dtype with C alignment, and
// every compiled source asserts the struct's size against it. A new option is
// one new field here (and, where it changes the code path, one template flag in the kernel).
#pragma once

struct FlashParams {
    // Tensors. q, k, v, out, dout, dq, dk, dv hold 16-bit floats (fp16 or bf16).
    const void* q;
    const void* k;
    const void* v;
    void* out;
    // lse is laid out as the stats strides below say ((batch, nheads, seqlen_q), or (nheads,
    // total_q) for varlen); the backward's scratch in its padded rows (dq_accum: headdim_padded floats each).
    float* lse;            // natural log; -inf for a row that sees no key
    const void* dout;
    void* dq;
    void* dk;
    void* dv;
    float* dq_accum;       // fp32, zeroed by flash_bwd_dot
    float* dout_dot_out;   // D = rowsum(dout * out), fp32, in the padded rows below
    float* lse_log2;       // lse * log2(e), +inf for a row that sees no key, in the padded rows

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
    int block_major;       // LOCAL kernels: the grid is (heads, blocks, batch), not (blocks, heads, batch) (mask.cuh grid_slot);
                           // the persistent forward: its tiles go block-major in groups of this many (batch, head) pairs

    // Softmax scale, and the same times log2(e) so the kernels can use exp2.
    float softmax_scale;
    float scale_log2;

    // Row statistics (lse) of (batch, head, row) sit at
    // batch * stats_batch_stride + head * stats_head_stride + first_row + row, first_row being
    // the sequence's first packed row (0 unless varlen).
    long long stats_batch_stride;
    long long stats_head_stride;
    // The backward's padded rows (dq_accum, lse_log2, dout_dot_out) are the same with every
    // sequence starting at a multiple of 64 rows (Sequence::padded_row0; dq_accum's layout is
    // dq_accum_index in common/mask.cuh).
    long long padded_batch_stride;
    long long padded_head_stride;

    // Variable-length batches: when set, sequence b is rows [cu[b], cu[b + 1]) of the packed
    // tensors (whose batch strides are then 0), and seqlen_q / seqlen_k above are the maxima.
    // The kernels clamp each sequence into [0, total) and to the maxima, so that cu_seqlens not
    // checked on the host (CUDA-graph capture, JAX) cannot send them outside the buffers.
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    int total_q;                    // packed rows of q and k
    int total_k;

    // Sliding window, read by the LOCAL kernels: row i sees keys [i + seqlen_k - seqlen_q - left,
    // i + seqlen_k - seqlen_q + right]. Causal is right = 0; an unbounded side is 1 << 30.
    int window_left;
    int window_right;

    // The score options (score.cuh; a kernel compiles in those its call uses), each off when zero / null.
    float softcap_inner;            // softcap: raw scores s become softcap_outer * tanh(s * softcap_inner),
    float softcap_outer;            //   inner = scale / softcap (0: off), outer = softcap / scale
    float inv_softmax_scale;        // 1 / softmax_scale: the kernels keep scores in raw units (q . k)
    const float* alibi_slopes;      // head h of batch b adds -slope * |i + seqlen_k - seqlen_q - j|
    long long alibi_batch_stride;   // 0 for slopes shaped (nheads,)
    const void* attn_bias;          // additive bias; the batch and head strides are 0 where it broadcasts
    long long bias_batch_stride;
    long long bias_head_stride;
    long long bias_row_stride;
    int bias_is_float32;            // else it has q's 16-bit dtype
    int bias_box_rows;              // the sm90 kernels with bias tiles: the rows of its tensor map's boxes, a tile's,
                                    //   or 1 where it is broadcast over the rows (sm90/fwd.cuh; their Bias is off)
    void* dbias;                    // dS, with the strides below (common/score.cuh, BiasGradient); null: not asked
    int dbias_is_float32;           // else it has q's 16-bit dtype (a bias of that dtype, not broadcast)
    int dbias_zero_unseen;          // the sm90 LOCAL backward zeros the rows its key blocks skip (sm90/bwd.cuh)
    long long dbias_batch_stride;
    long long dbias_head_stride;
    long long dbias_row_stride;
    long long dropout_seed;         // Philox key (cupyflash/reference/philox.py has the same generator)
    const void* dropout_seed_device; // when set, the key is read from here (8 bytes), so a graph replay sees a new one
    long long dropout_keep_max;     // the keep rule's bound (common/score.cuh, for_each_dropout_decision)
    float dropout_scale;            // 1 / the kept fraction; 0 disables dropout
    int* dq_semaphore;              // DETERMINISTIC backward: one zeroed counter per (batch, head, query block)
    int dq_semaphore_blocks;        // query blocks per (batch, head)
    int dq_accum_fragment_rows;     // 80-row wgmma backward: dq_accum by dq_accum_fragment_index in blocks of these rows; else 0
    int dq_stored_by_bwd;           // the sm90 backward's keys are one block, so each step's dQ is whole: it stores it
                                    //   in dq (flash_bwd_dot zeroes dq first, for rows no step sees); no dq_accum, no
                                    //   flash_bwd_convert_dq

    // The plain backward's last partial wave (TailSplit in sm80/bwd_schedule.cuh): the last tail_units
    // CTAs of the (blocks, nheads_k, batch) grid are done by tail_parts pieces each, CTAs of the
    // grid's z slices past the batch; 0 when not split.
    int tail_units;
    int tail_parts;
    float* dkv_accum;               // fp32, zeroed: the split key blocks' dK and dV, summed by the pieces
    int* tail_pieces_done;          // zeroed: one count per split key block
    int* tile_counter;              // the persistent LOCAL forward (sm90/fwd.cuh next_tile): zeroed, the tiles taken

    // The KV cache (sm80/decode.cuh): k and v above are the caches, whose batch stride steps one
    // cache row or, paged, one block of page_size rows. Lengths, rows and block ids read on the
    // device are clamped into the caches, so unchecked values (CUDA graphs, JAX) stay inside them.
    const void* k_new;              // (batch, seqlen_new, nheads_k, headdim), appended at cache_seqlens; or null
    const void* v_new;
    long long k_new_batch_stride;
    long long k_new_row_stride;
    long long k_new_head_stride;
    long long v_new_batch_stride;
    long long v_new_row_stride;
    long long v_new_head_stride;
    int seqlen_new;
    int capacity;                   // positions per sequence (the cache's length, or pages x page_size)
    int cache_rows;                 // the caches' dim 0: rows, or blocks when paged
    const int* cache_seqlens;       // per batch entry; null: cache_seqlens_all for every entry
    int cache_seqlens_all;
    const int* cache_batch_idx;     // the cache row of each batch entry; null: row b
    const int* cache_leftpad;       // the first position each sequence attends to; null: 0
    const int* block_table;         // (batch, pages) when paged, else null
    long long block_table_batch_stride;
    int page_size;
    const void* rotary_cos;         // (rotary_rows, rotary_dim / 2), q's 16-bit dtype or fp32; null: no rotary
    const void* rotary_sin;
    long long rotary_cos_row_stride;
    long long rotary_sin_row_stride;
    int rotary_rows;
    int rotary_dim;
    int rotary_interleaved;         // pairs (2j, 2j + 1), else (j, j + rotary_dim / 2)
    int rotary_is_float32;
    int rotary_q_per_row;           // q's row i turns at cache_seqlens + i (causal or local), else all at cache_seqlens
    int decode_heads_log2;          // a decode tile takes 1 << this kv heads together (sm80/decode.cuh)
    int num_splits;                 // key splits per (query block, kv head, batch entry)
    int merge_in_cluster;           // 1: a query block's splits are one thread-block cluster (sm_90), merged there
    float* out_partial;             // (num_splits, batch, nheads, seqlen_q, headdim): each split's normalised O
    float* lse_partial;             // (num_splits, batch, nheads, seqlen_q)
};
