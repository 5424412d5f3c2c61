// Which keys a query sees, and which whole blocks can be skipped. Every masking option lives
// here, so the forward and backward kernels agree by construction.
//
// Causal masking is aligned bottom-right (as flash_attn >= 2.1): query row i sees key j iff
// j <= i + seqlen_k - seqlen_q. With seqlen_q > seqlen_k the first rows see no key at all.
#pragma once
#include "params.cuh"

template <bool CAUSAL>
__device__ __forceinline__ bool is_visible(const FlashParams& p, int row, int col) {
    return col < p.seqlen_k && (!CAUSAL || col <= row + p.seqlen_k - p.seqlen_q);
}

// Number of key blocks that query rows [row0, row0 + block_m) see at all: blocks past it are
// fully masked and are skipped, not computed.
template <bool CAUSAL>
__device__ __forceinline__ int key_blocks_seen(const FlashParams& p, int row0, int block_m, int block_n) {
    int key_end = p.seqlen_k;
    if (CAUSAL) key_end = min(key_end, row0 + block_m + p.seqlen_k - p.seqlen_q);
    return key_end > 0 ? (key_end + block_n - 1) / block_n : 0;
}

// First query block that sees any key of the block starting at key0 (the backward's loop start).
template <bool CAUSAL>
__device__ __forceinline__ int first_query_block(const FlashParams& p, int key0, int block_m) {
    if (!CAUSAL) return 0;
    const int first_row = key0 - (p.seqlen_k - p.seqlen_q);
    return first_row > 0 ? first_row / block_m : 0;
}

// Whether a (query block, key block) pair needs per-element masking; all other pairs run the
// mask-free path.
template <bool CAUSAL>
__device__ __forceinline__ bool block_needs_mask(const FlashParams& p, int row0, int key0, int block_n) {
    const int key_last = key0 + block_n - 1;
    return key_last >= p.seqlen_k || (CAUSAL && key_last > row0 + p.seqlen_k - p.seqlen_q);
}
