"""NumPy reference implementations of attention: the oracle the CUDA kernels are checked against.

Layout (flash_attn's):
    q         (batch, seqlen_q, nheads, headdim)
    k, v      (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0
    out       like q
    lse       (batch, nheads, seqlen_q), natural log of the softmax denominator
Query head h reads kv head h // (nheads // nheads_k) (GQA / MQA).
The default softmax_scale is headdim ** -0.5.

Options (flash_attn's names and meaning; every default means "off"):
    causal        query row i sees key j only if j <= i + seqlen_k - seqlen_q
    window_size   (left, right): row i sees key j only if
                  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right;
                  -1 leaves that side unbounded. With causal the two masks intersect,
                  which is the same as right = 0.
    softcap       > 0 squashes the scores into (-softcap, softcap) with tanh
    alibi_slopes  (nheads,) or (batch, nheads): head h adds -slope[h] * |i + seqlen_k - seqlen_q - j|
    attn_bias     additive bias broadcastable from (batch or 1, nheads or 1, seqlen_q or 1, seqlen_k)
    dropout_p     > 0 drops probabilities after the softmax and rescales the kept ones by
                  1 / (1 - dropout_p), both with 1 - dropout_p rounded to a multiple of 2**-8
                  (dropout_rescale); the mask comes from a counter-based Philox RNG keyed by
    seed          (see dropout_keep_mask), so the CUDA kernels can reproduce it bit for bit
All masking is aligned to the bottom-right corner (flash_attn >= 2.1).

Empty rows: a query row that sees no key (causal with seqlen_q > seqlen_k, or a window that
misses every key) has out = 0 and lse = -inf (the log of an empty sum), and contributes zero
gradient to q, k and v. No function here returns NaN for such a row.

Three families of functions share one mask (`visible`), one score transform (`scaled_scores`,
whose docstring gives the order of the options) and one block-skipping rule
(`key_block_range` / `query_block_range`), all in _common.py, so every variant agrees:
  * attention_forward / attention_backward (naive.py): naive float64, full score matrix.
  * attention_forward_tiled / attention_backward_tiled (tiled.py): the FlashAttention-2
    algorithm written out tile by tile, also in float64.
  * attention_forward_lowp / attention_backward_lowp (lowp.py): float16 / bfloat16 emulation,
    the tolerance yardstick for GPU tests.
Variable-length (packed) batches, flash_attn's varlen layout, run every sequence as its own
batch-1 problem through the naive or low-precision functions: attention_*_varlen(_lowp) (varlen.py).
flash_attn_with_kvcache's append, rotary and attention over a (paged) cache: kvcache_attention
(kvcache.py).
Dropout's Philox generator is philox.py. Argument checks are the package's (cupyflash.validate,
cupyflash.options); this package only computes.
"""

from ._common import LN2, LOG2E, key_block_range, query_block_range, scaled_scores, score_bias, visible
from .kvcache import kvcache_attention, rotate
from .lowp import attention_backward_lowp, attention_forward_lowp, round_to
from .naive import attention_backward, attention_forward
from .philox import dropout_keep_mask, philox4x32_10
from .tiled import attention_backward_tiled, attention_forward_tiled
from .varlen import (attention_backward_varlen, attention_backward_varlen_lowp, attention_forward_varlen,
                     attention_forward_varlen_lowp)
from ..options import dropout_keep_threshold, dropout_rescale, window_bounds
from . import tiled  # tiled.tile_hook: a test hook

__all__ = ["attention_forward", "attention_backward", "attention_forward_tiled", "attention_backward_tiled",
           "attention_forward_lowp", "attention_backward_lowp", "attention_forward_varlen",
           "attention_backward_varlen", "attention_forward_varlen_lowp", "attention_backward_varlen_lowp",
           "visible", "key_block_range", "query_block_range", "scaled_scores", "score_bias", "round_to",
           "philox4x32_10", "dropout_keep_mask", "dropout_keep_threshold", "dropout_rescale", "window_bounds",
           "LOG2E", "LN2", "kvcache_attention", "rotate"]
