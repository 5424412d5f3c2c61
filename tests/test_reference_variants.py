"""CPU tests of the reference's dropout (Philox) and variable-length (packed) variants."""

import math

import numpy as np
import pytest

from cupyflash import reference as ref
from cupyflash import validate

pytest.register_assert_rewrite("reference_helpers")
from reference_helpers import (assert_lse_close, numerical_gradient, random_inputs,  # noqa: E402
                               reference_calls, rel_error, representable)

WORD = 0xFFFFFFFF


def philox_by_hand(counter, key):
    """Philox4x32-10 on Python ints, straight from the definition, one counter at a time."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(10):
        if round_index:
            k0, k1 = (k0 + 0x9E3779B9) & WORD, (k1 + 0xBB67AE85) & WORD
        product0, product1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (product1 >> 32) ^ c1 ^ k0, product1 & WORD, (product0 >> 32) ^ c3 ^ k1, product0 & WORD
    return c0, c1, c2, c3


def keep_count_by_hand(dropout_p):
    """Of 2**8 values of an element's 8 random bits, how many keep it: 1 - dropout_p to the nearest step."""
    return max(1, math.floor((1 - dropout_p) * 2**8 + 0.5))


def kept_by_hand(seed, dropout_p, b, h, i, j, nheads):
    """Whether dropout keeps score element (b, h, i, j), from the written spec alone, in the
    kernels' form: the element's byte shifted to the top of the word, against keep * 2**24 - 1."""
    words = philox_by_hand((j & ~9, i & ~9, b * nheads + h, 0), (seed & WORD, seed >> 32))
    keep = keep_count_by_hand(dropout_p)
    word = words[2 * (i & 1) + (j & 1)]
    byte = 2 * ((i >> 3) & 1) + ((j >> 3) & 1)
    return (word << (24 - 8 * byte)) & WORD <= (keep << 24) - 1


# --- Philox ------------------------------------------------------------------------------------

# Random123's published known-answer vectors (kat_vectors, philox4x32 10).
@pytest.mark.parametrize("counter, key, expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((WORD,) * 4, (WORD,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expected):
    words = ref.philox4x32_10(counter, key)
    assert words.dtype == np.uint32 and words.shape == (4,)
    assert tuple(int(w) for w in words) == expected
    assert philox_by_hand(counter, key) == expected


def test_philox_vectorised_matches_one_at_a_time():
    rng = np.random.default_rng(1)
    counters = rng.integers(0, 2**32, (4, 50), dtype=np.uint64)
    keys = rng.integers(0, 2**32, (2, 50), dtype=np.uint64)
    words = ref.philox4x32_10(counters, keys)
    assert words.shape == (4, 50)
    for n in range(50):
        expected = philox_by_hand([int(c) for c in counters[:, n]], [int(k) for k in keys[:, n]])
        assert tuple(int(w) for w in words[:, n]) == expected
    # Broadcasting: a (3, 1) word against a (1, 5) word and scalars gives (4, 3, 5).
    grid = ref.philox4x32_10((np.arange(3)[:, None], np.arange(5)[None, :], 7, 0), (11, 13))
    assert grid.shape == (4, 3, 5)
    assert tuple(int(w) for w in grid[:, 2, 4]) == philox_by_hand((2, 4, 7, 0), (11, 13))


def test_philox_rejects_words_outside_32_bits():
    with pytest.raises(ValueError, match="counter"):
        ref.philox4x32_10((2**32, 0, 0, 0), (0, 0))
    with pytest.raises(ValueError, match="key"):
        ref.philox4x32_10((0, 0, 0, 0), (-1, 0))
    with pytest.raises(TypeError):
        ref.philox4x32_10((0.5, 0, 0, 0), (0, 0))
    with pytest.raises(ValueError):
        ref.philox4x32_10((0, 0, 0), (0, 0))


# --- the keep mask -----------------------------------------------------------------------------

def test_keep_threshold():
    assert ref.dropout_keep_threshold(0.5) == 2**7
    assert ref.dropout_keep_threshold(0.0) == 2**8  # every element kept (dropout_p = 0 means none)
    assert ref.dropout_keep_threshold(0.1) == 230  # 0.9 * 2**8 = 230.4, to the nearest
    assert ref.dropout_keep_threshold(0.9) == 26  # 25.6, to the nearest
    assert ref.dropout_keep_threshold(1 / 3) == 171  # 170.67
    assert ref.dropout_keep_threshold(np.float32(0.25)) == 3 * 2**6
    assert ref.dropout_keep_threshold(1 - 2**-10) == 1  # rounds to 0: one step is kept
    assert ref.dropout_keep_threshold(2**-9) == 2**8  # 255.5 rounds up: all kept
    assert ref.dropout_rescale(0.1) == 2**8 / 230
    assert ref.dropout_rescale(0.5) == 2.0


# 0.4, and the keep counts' ends: 2**8 (everything kept) and 1 (one value in 2**8 kept).
@pytest.mark.parametrize("dropout_p", [0.4, 2**-12, 1 - 2**-9])
def test_mask_follows_the_word_mapping_element_by_element(dropout_p):
    seed, batch, nheads, seqlen_q, seqlen_k = 0x0123456789ABCDEF, 2, 3, 27, 19
    mask = ref.dropout_keep_mask(seed, dropout_p, batch, nheads, seqlen_q, seqlen_k)
    assert mask.dtype == bool and mask.shape == (batch, nheads, seqlen_q, seqlen_k)
    for index in np.ndindex(mask.shape):
        assert mask[index] == kept_by_hand(seed, dropout_p, *index, nheads), index


def test_one_philox_call_gives_four_mma_fragments_of_a_lane_pair():
    # Rows i, i + 1, i + 8, i + 9 and columns j, j + 1, j + 8, j + 9 (i and j with bits 0 and 3
    # clear): word 2 (row bit 0) + (column bit 0), byte 2 (row bit 3) + (column bit 3).
    seed, nheads, threshold = 99 + (5 << 32), 2, ref.dropout_keep_threshold(0.5)
    mask = ref.dropout_keep_mask(seed, 0.5, 2, nheads, 40, 30)
    for b, h, i, j in [(0, 0, 0, 0), (1, 1, 2, 6), (1, 0, 16, 18), (0, 1, 22, 4)]:
        words = philox_by_hand((j, i, b * nheads + h, 0), (99, 5))
        for row_tile in (0, 1):
            for col_tile in (0, 1):
                r, c = i + 8 * row_tile, j + 8 * col_tile
                elements = [mask[b, h, r, c], mask[b, h, r, c + 1], mask[b, h, r + 1, c], mask[b, h, r + 1, c + 1]]
                byte = 2 * row_tile + col_tile
                assert elements == [(w >> 8 * byte) & 0xFF < threshold for w in words]


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_binomial(dropout_p):
    mask = ref.dropout_keep_mask(2024, dropout_p, 2, 4, 64, 128)
    n, keep = mask.size, ref.dropout_keep_threshold(dropout_p) / 2**8
    # Under independent Bernoulli(keep) draws, the count lies within 5 sigma with probability
    # 1 - 6e-7; the expected fraction is the threshold's, not exactly 1 - dropout_p.
    assert abs(mask.sum() - n * keep) <= 5 * math.sqrt(n * keep * (1 - keep))
    # Each word position of the fragment (and each head) is kept at the same rate.
    for part in (mask[..., ::2], mask[..., 1::2], mask[:, :, 1::2], mask[:, :, 8:16], mask[..., 8:16], mask[:, 3]):
        m = part.size
        assert abs(part.sum() - m * keep) <= 5 * math.sqrt(m * keep * (1 - keep))


def test_mask_depends_on_seed_and_coordinates_only():
    shape = (2, 3, 21, 19)
    mask = ref.dropout_keep_mask(7, 0.5, *shape)
    np.testing.assert_array_equal(mask, ref.dropout_keep_mask(7, 0.5, *shape))
    for other_seed in (8, 7 + 2**32, 2**64 - 1):  # the key's high word counts too
        assert (mask != ref.dropout_keep_mask(other_seed, 0.5, *shape)).mean() > 0.3
    # Independent of the lengths: a smaller problem sees a corner of the bigger one.
    np.testing.assert_array_equal(ref.dropout_keep_mask(7, 0.5, 1, 3, 5, 11), mask[:1, :, :5, :11])
    # The counter holds b * nheads + h: batch 1 head 0 of 3 heads is head 3 of 6.
    np.testing.assert_array_equal(ref.dropout_keep_mask(7, 0.5, 1, 6, 21, 19)[0, 3], mask[1, 0])
    # A larger dropout_p only drops more (the words stay the same).
    assert not (ref.dropout_keep_mask(7, 0.7, *shape) & ~mask).any()


# --- dropout in the attention functions ---------------------------------------------------------

def all_calls(q, k, v, dout, **options):
    """Every dense attention function with the same options; returns a dict of their results."""
    out, lse = ref.attention_forward(q, k, v, **options)
    return {
        "forward": (out, lse),
        "backward": ref.attention_backward(dout, q, k, v, **options),
        "forward_tiled": ref.attention_forward_tiled(q, k, v, block_m=16, block_n=8, **options),
        "backward_tiled": ref.attention_backward_tiled(dout, q, k, v, out, lse, block_m=8, block_n=16, **options),
        "forward_lowp": ref.attention_forward_lowp(q, k, v, "float16", return_lse=True, **options),
        "backward_lowp": ref.attention_backward_lowp(dout, q, k, v, "bfloat16", **options),
    }


def test_dropout_p_zero_is_exactly_no_dropout():
    q, k, v, dout = random_inputs(11, 2, 13, 17, 4, 2, 8)
    plain = all_calls(q, k, v, dout, causal=True, softcap=2.0)
    for options in ({"dropout_p": 0.0}, {"dropout_p": 0, "seed": 5}, {"dropout_p": 0.0, "seed": "ignored"}):
        got = all_calls(q, k, v, dout, causal=True, softcap=2.0, **options)
        for name, results in plain.items():
            for expected, actual in zip(results, got[name]):
                np.testing.assert_array_equal(actual, expected, err_msg=name)


@pytest.mark.parametrize("options, error, message", [
    ({"dropout_p": 0.1}, ValueError, r"seed is required .*dropout_p=0.1"),
    ({"dropout_p": 0.1, "seed": -1}, ValueError, r"seed must be an integer in \[0, 2\*\*64\), got -1"),
    ({"dropout_p": 0.1, "seed": 2**64}, ValueError, r"seed must be .* got 18446744073709551616"),
    ({"dropout_p": 0.1, "seed": 1.0}, ValueError, r"seed must be .* got 1.0"),
    ({"dropout_p": 0.1, "seed": True}, ValueError, r"seed must be .* got True"),
    ({"dropout_p": 1.0, "seed": 1}, ValueError, r"dropout_p must be a real number in \[0, 1\), got 1.0"),
    ({"dropout_p": -0.1, "seed": 1}, ValueError, r"dropout_p must be .* got -0.1"),
    ({"dropout_p": float("nan"), "seed": 1}, ValueError, r"dropout_p must be .* got nan"),
    ({"dropout_p": True, "seed": 1}, TypeError, r"dropout_p must be .* got True"),
    ({"dropout_p": "0.1", "seed": 1}, TypeError, r"dropout_p must be .* got '0.1'"),
    ({"dropout_p": None}, TypeError, r"dropout_p must be .* got None"),
])
def test_rejects_bad_dropout_arguments(options, error, message):
    q, k, v, dout = random_inputs(12, 1, 5, 6, 2, 2, 8)
    cu = np.array([0, 5], dtype=np.int32)
    calls = reference_calls(q, k, v, dout, options) + [
        lambda: ref.attention_forward_varlen(q[0], k[0, :5], v[0, :5], cu, cu, **options),
        lambda: ref.attention_backward_varlen_lowp(dout[0], q[0], k[0, :5], v[0, :5], cu, cu, "float16",
                                                   **options),
        lambda: ref.dropout_keep_mask(options.get("seed"), options["dropout_p"], 1, 2, 5, 6),
    ]
    for call in calls:
        with pytest.raises(error, match=message):
            call()


def test_dropout_output_is_kept_probabilities_rescaled_and_lse_unchanged():
    # With v = identity (headdim == seqlen_k), out is the matrix that multiplied V.
    seed, dropout_p, batch, seqlen_q, seqlen_k, nheads = 31, 0.3, 2, 9, 12, 4
    q, k, _, _ = random_inputs(13, batch, seqlen_q, seqlen_k, nheads, 2, seqlen_k)
    v = np.broadcast_to(np.eye(seqlen_k)[None, :, None, :], (batch, seqlen_k, 2, seqlen_k)).copy()
    mask = ref.dropout_keep_mask(seed, dropout_p, batch, nheads, seqlen_q, seqlen_k).transpose(0, 2, 1, 3)
    for causal in (False, True):
        p, lse = ref.attention_forward(q, k, v, causal=causal)
        expected = np.where(mask, p * 2**8 / keep_count_by_hand(dropout_p), 0)
        for forward in (ref.attention_forward, ref.attention_forward_tiled):
            out, lse_d = forward(q, k, v, causal=causal, dropout_p=dropout_p, seed=seed)
            np.testing.assert_allclose(out, expected, rtol=1e-14, atol=1e-15)
            np.testing.assert_array_equal(lse_d, forward(q, k, v, causal=causal)[1])
        _, lse16 = ref.attention_forward_lowp(q, k, v, "float16", causal=causal, return_lse=True,
                                              dropout_p=dropout_p, seed=seed)
        np.testing.assert_array_equal(lse16, ref.attention_forward_lowp(q, k, v, "float16", causal=causal,
                                                                        return_lse=True)[1])


def test_lowp_dropout_rounds_each_step():
    # k = identity makes dq the (scaled) dS itself, so each documented rounding can be replayed:
    # P*M*rescale rounded before the product, dP*M*rescale rounded, as autograd would compute them.
    dtype, seed, dropout_p, n, nheads, scale = "float16", 5, 0.3, 8, 2, 0.5
    q, _, v, dout = random_inputs(14, 1, n, n, nheads, nheads, n)
    k = np.broadcast_to(np.eye(n)[None, :, None, :], (1, n, nheads, n)).copy()
    eye_v = k
    round16 = lambda x: ref.round_to(x, dtype)  # noqa: E731
    heads_first = lambda x: np.ascontiguousarray(round16(x).transpose(0, 2, 1, 3))  # noqa: E731
    keep = ref.dropout_keep_mask(seed, dropout_p, 1, nheads, n, n)
    rescale = np.float32(2**8 / keep_count_by_hand(dropout_p))
    options = {"softmax_scale": scale, "causal": True}
    # The rounded softmax, seen through v = identity without dropout.
    p = heads_first(ref.attention_forward_lowp(q, k, eye_v, dtype, **options))
    dropped = round16(np.where(keep, p * rescale, 0))
    out = ref.attention_forward_lowp(q, k, eye_v, dtype, dropout_p=dropout_p, seed=seed, **options)
    np.testing.assert_array_equal(heads_first(out), dropped)
    out = ref.attention_forward_lowp(q, k, v, dtype, dropout_p=dropout_p, seed=seed, **options)
    np.testing.assert_array_equal(heads_first(out), round16(dropped @ heads_first(v)))

    dp = round16(heads_first(dout) @ heads_first(v).swapaxes(-1, -2))
    dp = round16(np.where(keep, dp * rescale, 0))
    ds = round16(p * (dp - (dp * p).sum(axis=-1, keepdims=True)))
    dq = ref.attention_backward_lowp(dout, q, k, v, dtype, dropout_p=dropout_p, seed=seed, **options)[0]
    np.testing.assert_array_equal(heads_first(dq), round16(ds * np.float32(scale)))


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, options, (block_m, block_n))
DROPOUT_CASES = [
    (2, 17, 33, 4, 2, 16, {"causal": True, "dropout_p": 0.1}, (16, 16)),
    (1, 33, 17, 4, 2, 8, {"causal": True, "dropout_p": 0.5}, (8, 16)),  # empty rows
    (2, 1, 17, 4, 2, 8, {"dropout_p": 0.9}, (16, 8)),  # decoding
    (1, 17, 1, 4, 4, 8, {"causal": True, "dropout_p": 0.5}, (16, 16)),  # one key
    (1, 33, 33, 4, 2, 8, {"window_size": (5, 3), "softcap": 2.0, "alibi": "bh", "dropout_p": 0.3},
     (32, 8)),
    (2, 17, 33, 4, 1, 8, {"bias": ("b", 1, "q", "k"), "causal": True, "dropout_p": 0.25}, (8, 8)),
]


def dropout_case(case_index, seed_offset):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, spec, blocks = DROPOUT_CASES[case_index]
    q, k, v, dout = random_inputs(seed_offset + case_index, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    rng = np.random.default_rng(seed_offset + 50 + case_index)
    sizes = {"b": batch, "h": nheads, "q": seqlen_q, "k": seqlen_k, 1: 1}
    options = {key: spec[key] for key in ("causal", "window_size", "softcap", "dropout_p") if key in spec}
    if "alibi" in spec:
        options["alibi_slopes"] = rng.uniform(0.05, 0.6, tuple(sizes[c] for c in spec["alibi"]))
    if "bias" in spec:
        options["attn_bias"] = rng.standard_normal(tuple(sizes[c] for c in spec["bias"]))
    options["seed"] = int(rng.integers(0, 2**63)) * 2 + 1  # both key words nonzero
    return (q, k, v, dout), options, blocks


@pytest.mark.parametrize("case_index", range(len(DROPOUT_CASES)))
def test_dropout_tiled_matches_naive(case_index):
    (q, k, v, dout), options, (block_m, block_n) = dropout_case(case_index, 600)
    out, lse = ref.attention_forward(q, k, v, **options)
    out_t, lse_t = ref.attention_forward_tiled(q, k, v, block_m=block_m, block_n=block_n, **options)
    assert rel_error(out_t, out) < 1e-12
    assert_lse_close(lse_t, lse, 1e-12)
    # Dropout really changed the output.
    plain = {key: value for key, value in options.items() if key not in ("dropout_p", "seed")}
    assert rel_error(out, ref.attention_forward(q, k, v, **plain)[0]) > 1e-3

    grads = ref.attention_backward(dout, q, k, v, **options)
    grads_t = ref.attention_backward_tiled(dout, q, k, v, out, lse, block_m=block_m, block_n=block_n, **options)
    for g, g_t, x in zip(grads, grads_t, (q, k, v)):
        assert g.shape == g_t.shape == x.shape and np.isfinite(g_t).all()
        assert rel_error(g_t, g) < 1e-12


@pytest.mark.parametrize("shape, options", [
    ((2, 4, 3, 2, 2, 3), {"dropout_p": 0.4}),
    ((1, 3, 5, 4, 2, 4), {"dropout_p": 0.5, "causal": True}),  # GQA
    ((1, 9, 10, 2, 1, 2), {"dropout_p": 0.3, "softcap": 1.5, "alibi_slopes": np.array([0.2, 0.5])}),  # rows 8..9
])
def test_dropout_backward_matches_finite_differences(shape, options):
    q, k, v, w = random_inputs(sum(shape), *shape)
    options = dict(options, softmax_scale=0.7, seed=123456789012345)

    def loss():
        # The mask is fixed by the seed, so this is a smooth function of q, k, v.
        out, _ = ref.attention_forward(q, k, v, **options)
        return np.sum(out * w)

    analytic = ref.attention_backward(w, q, k, v, **options)
    for x, grad in zip((q, k, v), analytic):
        assert rel_error(grad, numerical_gradient(loss, x)) < 1e-6


def test_dropout_lowp_is_close_and_ordered():
    q, k, v, dout = random_inputs(71, 2, 37, 29, 4, 2, 32)
    options = {"causal": True, "dropout_p": 0.2, "seed": 77, "alibi_slopes": np.full(4, 0.1)}
    exact = (ref.attention_forward(q, k, v, **options)[0],) + ref.attention_backward(dout, q, k, v, **options)
    errors = {}
    for dtype in ("float16", "bfloat16"):
        low = (ref.attention_forward_lowp(q, k, v, dtype, **options),) + \
            ref.attention_backward_lowp(dout, q, k, v, dtype, **options)
        for x in low:
            assert x.dtype == np.float32 and representable(x, dtype)
        errors[dtype] = [rel_error(x, x_exact) for x, x_exact in zip(low, exact)]
    for e16, ebf in zip(errors["float16"], errors["bfloat16"]):
        assert 0 < e16 < ebf < 5e-2
    assert max(errors["float16"]) < 1e-2


# --- variable-length batches ---------------------------------------------------------------------

LENGTHS_Q, LENGTHS_K = [0, 1, 17, 5], [3, 0, 17, 9]


def packed_inputs(seed, lengths_q, lengths_k, nheads, nheads_k, headdim):
    """Packed q, k, v, dout and their int32 cu_seqlens."""
    rng = np.random.default_rng(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = rng.standard_normal((total_q, nheads, headdim))
    k = rng.standard_normal((total_k, nheads_k, headdim))
    v = rng.standard_normal((total_k, nheads_k, headdim))
    dout = rng.standard_normal((total_q, nheads, headdim))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32) for lengths in (lengths_q, lengths_k))
    return q, k, v, dout, cu_q, cu_k


def as_batch_index(x, b):
    """x (seqlen, ...) placed at index b of a zero batch of b + 1: dense calls then use b as the
    batch index of the dropout counter and of (batch, nheads) ALiBi slopes."""
    batch = np.zeros((b + 1,) + x.shape, dtype=x.dtype)
    batch[b] = x
    return batch


VARLEN_SPECS = [
    {},
    {"causal": True},
    {"window_size": (4, 2)},
    {"alibi": "bh", "causal": True},
    {"alibi": "h", "softcap": 2.0},
    {"dropout_p": 0.3, "seed": 1234},
    {"dropout_p": 0.5, "seed": 2**63 + 5, "causal": True, "alibi": "bh", "window_size": (6, 1), "softcap": 3.0},
]


def varlen_options(spec, batch, nheads):
    options = {key: value for key, value in spec.items() if key != "alibi"}
    if "alibi" in spec:
        shape = (batch, nheads) if spec["alibi"] == "bh" else (nheads,)
        options["alibi_slopes"] = np.random.default_rng(batch).uniform(0.05, 0.6, shape)
    return options


def dense_options(options, b):
    """The options of sequence b for a dense call on as_batch_index arrays."""
    slopes = options.get("alibi_slopes")
    if slopes is not None and slopes.ndim == 2:
        options = dict(options, alibi_slopes=as_batch_index(slopes[b], b))
    return options


@pytest.mark.parametrize("spec_index", range(len(VARLEN_SPECS)))
def test_varlen_equals_dense_per_sequence(spec_index):
    nheads, nheads_k = 4, 2
    q, k, v, dout, cu_q, cu_k = packed_inputs(700 + spec_index, LENGTHS_Q, LENGTHS_K, nheads, nheads_k, 8)
    options = varlen_options(VARLEN_SPECS[spec_index], len(LENGTHS_Q), nheads)
    out, lse = ref.attention_forward_varlen(q, k, v, cu_q, cu_k, **options)
    grads = ref.attention_backward_varlen(dout, q, k, v, cu_q, cu_k, **options)
    low_out, low_lse = ref.attention_forward_varlen_lowp(q, k, v, cu_q, cu_k, "bfloat16", return_lse=True,
                                                         **options)
    low_grads = ref.attention_backward_varlen_lowp(dout, q, k, v, cu_q, cu_k, "float16", **options)
    assert out.shape == q.shape and out.dtype == np.float64
    assert lse.shape == (nheads, len(q)) and lse.dtype == np.float64
    assert low_out.dtype == np.float32 and low_lse.shape == lse.shape
    for g, low_g, x in zip(grads, low_grads, (q, k, v)):
        assert g.shape == low_g.shape == x.shape and low_g.dtype == np.float32

    for b in range(len(LENGTHS_Q)):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if LENGTHS_Q[b] == 0 or LENGTHS_K[b] == 0:
            continue  # checked in test_varlen_empty_sequences
        dense = [as_batch_index(x[rows], b) for x, rows in ((q, rows_q), (k, rows_k), (v, rows_k), (dout, rows_q))]
        opts_b = dense_options(options, b)
        out_b, lse_b = ref.attention_forward(*dense[:3], **opts_b)
        assert rel_error(out[rows_q], out_b[b]) < 1e-14
        assert_lse_close(lse[:, rows_q], lse_b[b], 1e-14)
        for g, g_b, rows in zip(grads, ref.attention_backward(dense[3], *dense[:3], **opts_b),
                                (rows_q, rows_k, rows_k)):
            assert rel_error(g[rows], g_b[b]) < 1e-13

        low_out_b, low_lse_b = ref.attention_forward_lowp(*dense[:3], "bfloat16", return_lse=True, **opts_b)
        np.testing.assert_array_equal(low_out[rows_q], low_out_b[b])
        np.testing.assert_array_equal(low_lse[:, rows_q], low_lse_b[b])
        low_grads_b = ref.attention_backward_lowp(dense[3], *dense[:3], "float16", **opts_b)
        for g, g_b, rows in zip(low_grads, low_grads_b, (rows_q, rows_k, rows_k)):
            np.testing.assert_array_equal(g[rows], g_b[b])


def test_varlen_empty_sequences():
    nheads, nheads_k = 4, 2
    q, k, v, dout, cu_q, cu_k = packed_inputs(710, LENGTHS_Q, LENGTHS_K, nheads, nheads_k, 8)
    options = {"causal": True, "dropout_p": 0.2, "seed": 3}
    out, lse = ref.attention_forward_varlen(q, k, v, cu_q, cu_k, **options)
    dq, dk, dv = ref.attention_backward_varlen(dout, q, k, v, cu_q, cu_k, **options)
    low_out, low_lse = ref.attention_forward_varlen_lowp(q, k, v, cu_q, cu_k, "float16", return_lse=True, **options)
    low_grads = ref.attention_backward_varlen_lowp(dout, q, k, v, cu_q, cu_k, "float16", **options)
    # Sequence 1: one query, no key: out 0, lse -inf, no gradient.
    assert (out[0] == 0).all() and np.isneginf(lse[:, 0]).all() and (dq[0] == 0).all()
    assert (low_out[0] == 0).all() and np.isneginf(low_lse[:, 0]).all() and (low_grads[0][0] == 0).all()
    # Sequence 0: three keys, no query: they get no gradient.
    assert (dk[:3] == 0).all() and (dv[:3] == 0).all()
    assert (low_grads[1][:3] == 0).all() and (low_grads[2][:3] == 0).all()
    assert all(np.isfinite(x).all() for x in (out, dq, dk, dv, low_out) + low_grads)
    # No sequence at all.
    none = np.zeros((0, nheads, 8)), np.zeros((0, nheads_k, 8)), np.zeros((0, nheads_k, 8))
    cu = np.zeros(1, dtype=np.int32)
    out0, lse0 = ref.attention_forward_varlen(*none, cu, cu)
    assert out0.shape == (0, nheads, 8) and lse0.shape == (nheads, 0)
    assert [g.shape for g in ref.attention_backward_varlen(none[0], *none, cu, cu)] == [x.shape for x in none]


def test_varlen_with_equal_lengths_is_the_dense_batch():
    # Sequence b uses b as the batch index of the dropout counter, exactly as the dense batch does.
    batch, seqlen_q, seqlen_k, nheads = 3, 13, 19, 4
    q, k, v, dout = random_inputs(720, batch, seqlen_q, seqlen_k, nheads, 2, 8)
    slopes = np.random.default_rng(721).uniform(0.1, 0.5, (batch, nheads))
    options = {"causal": True, "alibi_slopes": slopes, "dropout_p": 0.4, "seed": 99}
    cu_q = np.arange(0, batch * seqlen_q + 1, seqlen_q, dtype=np.int32)
    cu_k = np.arange(0, batch * seqlen_k + 1, seqlen_k, dtype=np.int32)
    packed = [x.reshape((-1,) + x.shape[2:]) for x in (q, k, v, dout)]
    out, lse = ref.attention_forward(q, k, v, **options)
    out_v, lse_v = ref.attention_forward_varlen(*packed[:3], cu_q, cu_k, **options)
    assert rel_error(out_v, out.reshape(packed[0].shape)) < 1e-14
    assert_lse_close(lse_v, lse.transpose(1, 0, 2).reshape(nheads, -1), 1e-14)
    grads = ref.attention_backward(dout, q, k, v, **options)
    grads_v = ref.attention_backward_varlen(packed[3], *packed[:3], cu_q, cu_k, **options)
    for g, g_v in zip(grads, grads_v):
        assert rel_error(g_v, g.reshape(g_v.shape)) < 1e-13


@pytest.mark.parametrize("cu_seqlens, batch, error, message", [
    ([0, 3, 5], None, TypeError, r"cu_seqlens_q must be an int32 array, got list"),
    (np.array([0, 3, 5]), None, TypeError, r"cu_seqlens_q must be an int32 array, got dtype int64"),
    (np.array([0.0, 3.0, 5.0], dtype=np.float32), None, TypeError, r"cu_seqlens_q .* got dtype float32"),
    (np.array([[0, 3, 5]], dtype=np.int32), None, ValueError, r"cu_seqlens_q must be 1-D .* got shape \(1, 3\)"),
    (np.array([0, 3, 5], dtype=np.int32), 3, ValueError, r"cu_seqlens_q must have length batch \+ 1 = 4, got 3"),
    (np.array([], dtype=np.int32), None, ValueError, r"cu_seqlens_q must have length .* empty"),
    (np.array([1, 3, 5], dtype=np.int32), None, ValueError,
     r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1"),
    (np.array([0, 4, 3, 5], dtype=np.int32), None, ValueError,
     r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\] = 4 > cu_seqlens_q\[2\] = 3"),
    (np.array([0, 3, 6], dtype=np.int32), None, ValueError,
     r"cu_seqlens_q must end at the packed length 5, got cu_seqlens_q\[-1\] = 6"),
])
def test_check_cu_seqlens_rejects(cu_seqlens, batch, error, message):
    with pytest.raises(error, match=message):
        validate.check_cu_seqlens("cu_seqlens_q", cu_seqlens, batch, 5)


def test_check_cu_seqlens_and_max_seqlen_accept_good_values():
    cu = np.array([0, 0, 3, 3, 10], dtype=np.int32)
    np.testing.assert_array_equal(validate.check_cu_seqlens("cu_seqlens_k", cu, 4, 10), cu)
    np.testing.assert_array_equal(validate.check_cu_seqlens("cu_seqlens_k", cu, None, 10), cu)
    validate.check_cu_seqlens("cu", np.zeros(1, dtype=np.int32), 0, 0)
    for max_seqlen in (7, 8, np.int32(7), 10**6):
        validate.check_max_seqlen("max_seqlen_k", max_seqlen, cu)
    validate.check_max_seqlen("max_seqlen_q", 0, np.zeros(3, dtype=np.int32))


@pytest.mark.parametrize("max_seqlen, message", [
    (6, r"max_seqlen_k must be >= the longest sequence \(7\), got 6"),
    (-1, r"max_seqlen_k must be >= .* got -1"),
    (7.0, r"max_seqlen_k must be an integer, got 7.0"),
    (True, r"max_seqlen_k must be an integer, got True"),
    (None, r"max_seqlen_k must be an integer, got None"),
    ("7", r"max_seqlen_k must be an integer, got '7'"),
])
def test_check_max_seqlen_rejects(max_seqlen, message):
    with pytest.raises(ValueError, match=message):
        validate.check_max_seqlen("max_seqlen_k", max_seqlen, np.array([0, 0, 3, 3, 10], dtype=np.int32))


def test_varlen_functions_reject_bad_arguments():
    q, k, v, dout, cu_q, cu_k = packed_inputs(730, LENGTHS_Q, LENGTHS_K, 4, 2, 8)
    # The backward calls get a dout shaped like the q they are given.
    calls = [
        lambda *a, **o: ref.attention_forward_varlen(*a, **o),
        lambda *a, **o: ref.attention_backward_varlen(np.ones(a[0].shape), *a, **o),
        lambda *a, **o: ref.attention_forward_varlen_lowp(*a, "float16", **o),
        lambda *a, **o: ref.attention_backward_varlen_lowp(np.ones(a[0].shape), *a, "bfloat16", **o),
    ]
    bad = [
        ((q, k, v, cu_q.astype(np.int64), cu_k), {}, TypeError, "cu_seqlens_q"),
        ((q, k, v, cu_q, cu_k[:-1]), {}, ValueError, r"cu_seqlens_k must have length batch \+ 1 = 5, got 4"),
        ((q, k, v, cu_q, cu_k + np.int32(1)), {}, ValueError, "cu_seqlens_k must start at 0"),
        ((q[:-1], k, v, cu_q, cu_k), {}, ValueError, "cu_seqlens_q must end at the packed length 22"),
        ((q[None], k[None], v[None], cu_q, cu_k), {}, ValueError, "3-d"),
        ((q[:, :3], k, v, cu_q, cu_k), {}, ValueError, "multiple of nheads_k"),
        ((q, k, v, cu_q, cu_k), {"alibi_slopes": np.ones((3, 4))}, ValueError, r"alibi_slopes must have shape"),
        ((q, k, v, cu_q, cu_k), {"window_size": (-2, 0)}, ValueError, "window_size"),
    ]
    for args, options, error, message in bad:
        for call in calls:
            with pytest.raises(error, match=message):
                call(*args, **options)
    with pytest.raises(ValueError, match="dout must have q's shape"):
        ref.attention_backward_varlen(dout[:-1], q, k, v, cu_q, cu_k)
