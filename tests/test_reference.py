"""CPU tests of the NumPy reference (cupyflash/reference.py)."""

import numpy as np
import pytest

from cupyflash import reference as ref


def random_inputs(seed, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim):
    """q, k, v and dout in flash_attn's layout, float64 standard normal."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim))
    k = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    v = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    dout = rng.standard_normal((batch, seqlen_q, nheads, headdim))
    return q, k, v, dout


def rel_error(actual, expected):
    """Largest absolute error relative to the largest magnitude of expected."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    scale = np.abs(expected).max()
    return np.abs(actual - expected).max() / (scale if scale > 0 else 1.0)


def assert_lse_close(actual, expected, rtol):
    """Same -inf rows, finite rows close."""
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    assert np.isfinite(actual[finite]).all()
    assert rel_error(actual[finite], expected[finite]) < rtol


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, block_m, block_n)
TILED_CASES = [
    (1, 1, 1, 1, 1, 8, False, 64, 64),
    (1, 1, 1, 1, 1, 8, True, 64, 64),
    (2, 17, 17, 2, 2, 40, True, 16, 16),
    (1, 113, 113, 2, 2, 72, False, 64, 64),
    (1, 113, 113, 2, 2, 72, True, 64, 64),
    (1, 113, 17, 4, 1, 40, False, 32, 16),  # MQA
    (2, 17, 113, 4, 1, 8, True, 16, 32),  # causal, seqlen_q < seqlen_k, MQA
    (1, 113, 40, 8, 2, 72, True, 32, 16),  # causal, seqlen_q > seqlen_k (empty rows), GQA 4:1
    (1, 1, 113, 4, 1, 40, True, 64, 64),  # decoding: one query sees every key
    (1, 113, 1, 4, 4, 8, True, 16, 64),  # only the last query row sees the key
    (2, 113, 113, 4, 1, 40, True, 64, 16),
]


@pytest.mark.parametrize("case_index", range(len(TILED_CASES)))
def test_tiled_forward_matches_naive(case_index):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, block_m, block_n = TILED_CASES[case_index]
    q, k, v, _ = random_inputs(100 + case_index, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    out, lse = ref.attention_forward(q, k, v, causal=causal)
    out_t, lse_t = ref.attention_forward_tiled(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    assert out.dtype == out_t.dtype == np.float64
    assert out.shape == q.shape and lse.shape == (batch, nheads, seqlen_q)
    assert rel_error(out_t, out) < 1e-12
    assert_lse_close(lse_t, lse, 1e-12)


@pytest.mark.parametrize("case_index", range(len(TILED_CASES)))
def test_tiled_backward_matches_naive(case_index):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, block_m, block_n = TILED_CASES[case_index]
    q, k, v, dout = random_inputs(200 + case_index, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    out, lse = ref.attention_forward(q, k, v, causal=causal)
    grads = ref.attention_backward(dout, q, k, v, causal=causal)
    grads_t = ref.attention_backward_tiled(dout, q, k, v, out, lse, causal=causal,
                                           block_m=block_m, block_n=block_n)
    for g, g_t, x in zip(grads, grads_t, (q, k, v)):
        assert g.shape == g_t.shape == x.shape
        assert np.isfinite(g_t).all()
        assert rel_error(g_t, g) < 1e-12


def numerical_gradient(loss, x, eps=1e-5):
    """Central finite differences of the scalar loss() with respect to every entry of x."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        saved = x[index]
        x[index] = saved + eps
        plus = loss()
        x[index] = saved - eps
        minus = loss()
        x[index] = saved
        grad[index] = (plus - minus) / (2 * eps)
    return grad


@pytest.mark.parametrize(
    "seed, shape, causal",
    [
        (1, (2, 4, 3, 2, 2, 3), False),
        (2, (1, 3, 5, 4, 2, 4), True),  # GQA, seqlen_q < seqlen_k
        (3, (1, 4, 2, 2, 1, 3), True),  # MQA, two empty rows
    ],
)
def test_backward_matches_finite_differences(seed, shape, causal):
    q, k, v, w = random_inputs(seed, *shape)
    scale = 0.7  # not the default, so a wrong scale in the backward shows

    def loss():
        out, _ = ref.attention_forward(q, k, v, softmax_scale=scale, causal=causal)
        return np.sum(out * w)

    # d loss / d out = w, so the analytic gradient uses dout = w.
    analytic = ref.attention_backward(w, q, k, v, softmax_scale=scale, causal=causal)
    for x, grad in zip((q, k, v), analytic):
        assert rel_error(grad, numerical_gradient(loss, x)) < 1e-6


def test_gqa_equals_mha_with_repeated_kv_heads():
    group = 3
    q, k, v, dout = random_inputs(7, 2, 19, 23, 6, 2, 16)
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    for causal in (False, True):
        out, lse = ref.attention_forward(q, k, v, causal=causal)
        out_rep, lse_rep = ref.attention_forward(q, k_rep, v_rep, causal=causal)
        np.testing.assert_array_equal(out, out_rep)
        np.testing.assert_array_equal(lse, lse_rep)

        dq, dk, dv = ref.attention_backward(dout, q, k, v, causal=causal)
        dq_rep, dk_rep, dv_rep = ref.attention_backward(dout, q, k_rep, v_rep, causal=causal)
        np.testing.assert_allclose(dq, dq_rep, rtol=1e-13, atol=1e-13)
        # Each kv head's gradient is the sum over the query heads of its group.
        batch, seqlen_k, nheads_k, headdim = k.shape
        for g, g_rep in ((dk, dk_rep), (dv, dv_rep)):
            summed = g_rep.reshape(batch, seqlen_k, nheads_k, group, headdim).sum(axis=3)
            np.testing.assert_allclose(g, summed, rtol=1e-13, atol=1e-13)


def direct_attention(q, k, v, scale, causal):
    """Loop-based attention straight from the definition, for a few small checks."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    out = np.zeros(q.shape[:3] + (v.shape[3],))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            kv_head = h // (nheads // nheads_k)
            for i in range(seqlen_q):
                keys = [j for j in range(seqlen_k) if not causal or j <= i + seqlen_k - seqlen_q]
                if not keys:
                    continue
                logits = np.array([q[b, i, h] @ k[b, j, kv_head] * scale for j in keys])
                weights = np.exp(logits - logits.max())
                lse[b, h, i] = np.log(weights.sum()) + logits.max()
                out[b, i, h] = (weights / weights.sum()) @ v[b, keys, kv_head]
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(5, 7), (7, 5), (6, 6)])
def test_forward_and_lse_match_direct_definition(seqlen_q, seqlen_k, causal):
    q, k, v, _ = random_inputs(seqlen_q * 10 + seqlen_k, 2, seqlen_q, seqlen_k, 4, 2, 6)
    out_direct, lse_direct = direct_attention(q, k, v, 6 ** -0.5, causal)
    out, lse = ref.attention_forward(q, k, v, causal=causal)  # default scale is headdim ** -0.5
    assert rel_error(out, out_direct) < 1e-13
    assert_lse_close(lse, lse_direct, 1e-13)


def test_softmax_rows_sum_to_one():
    # With v = identity (seqlen_k == headdim), out is the probability matrix P itself.
    seqlen_q, seqlen_k, nheads = 9, 12, 2
    q, k, _, _ = random_inputs(11, 1, seqlen_q, seqlen_k, nheads, nheads, seqlen_k)
    v = np.broadcast_to(np.eye(seqlen_k)[None, :, None, :], k.shape).copy()
    for causal in (False, True):
        p, _ = ref.attention_forward(q, k, v, causal=causal)
        assert (p >= 0).all()
        np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=0, atol=1e-14)
        if causal:  # row i of P is zero beyond key i + seqlen_k - seqlen_q
            hidden = ~ref.visible(seqlen_q, seqlen_k, True)
            assert (p[0, :, 0][hidden] == 0).all()


def test_visible_is_aligned_bottom_right():
    expected = np.array([[1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(ref.visible(2, 5, True), expected)
    expected = np.array([[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]], dtype=bool)
    np.testing.assert_array_equal(ref.visible(5, 2, True), expected)
    assert ref.visible(3, 4, False).all() and ref.visible(3, 4, False).shape == (3, 4)
    # A tile is the corresponding piece of the full matrix.
    full = ref.visible(37, 29, True)
    np.testing.assert_array_equal(ref.visible(37, 29, True, slice(16, 32), slice(8, 16)), full[16:32, 8:16])


def test_causal_hand_checked_case():
    # seqlen_q = 2, seqlen_k = 5: row 0 sees keys 0..3, row 1 sees keys 0..4.
    q, k, v, _ = random_inputs(21, 1, 2, 5, 1, 1, 4)
    out, lse = ref.attention_forward(q, k, v, causal=True)
    row0, lse0 = ref.attention_forward(q[:, :1], k[:, :4], v[:, :4])
    row1, lse1 = ref.attention_forward(q[:, 1:], k, v)
    np.testing.assert_allclose(out[:, :1], row0, rtol=1e-14)
    np.testing.assert_allclose(out[:, 1:], row1, rtol=1e-14)
    np.testing.assert_allclose(lse[..., 0], lse0[..., 0], rtol=1e-14)
    np.testing.assert_allclose(lse[..., 1], lse1[..., 0], rtol=1e-14)


def test_rows_without_keys_give_zero_out_minus_inf_lse_and_zero_gradient():
    # seqlen_q = 5, seqlen_k = 2, causal: rows 0..2 see no key, row 3 sees key 0, row 4 keys 0..1.
    q, k, v, dout = random_inputs(31, 2, 5, 2, 2, 1, 8)
    for forward in (ref.attention_forward, ref.attention_forward_tiled):
        out, lse = forward(q, k, v, causal=True)
        assert (out[:, :3] == 0).all() and np.isfinite(out).all()
        assert np.isneginf(lse[:, :, :3]).all() and np.isfinite(lse[:, :, 3:]).all()

    out, lse = ref.attention_forward(q, k, v, causal=True)
    naive = ref.attention_backward(dout, q, k, v, causal=True)
    tiled = ref.attention_backward_tiled(dout, q, k, v, out, lse, causal=True, block_m=2, block_n=1)
    # The empty rows must not influence dk, dv: they equal the gradients of rows 3..4 alone.
    dk_rest, dv_rest = ref.attention_backward(dout[:, 3:], q[:, 3:], k, v, causal=True)[1:]
    for dq, dk, dv in (naive, tiled):
        assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
        assert (dq[:, :3] == 0).all()
        np.testing.assert_allclose(dk, dk_rest, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(dv, dv_rest, rtol=1e-12, atol=1e-14)

    # The low-precision emulation follows the same convention.
    for dtype in ("float16", "bfloat16"):
        assert (ref.attention_forward_lowp(q, k, v, dtype, causal=True)[:, :3] == 0).all()
        for grad in ref.attention_backward_lowp(dout, q, k, v, dtype, causal=True):
            assert np.isfinite(grad).all()


def test_default_scale_and_explicit_scale():
    q, k, v, dout = random_inputs(41, 1, 7, 9, 2, 2, 12)
    out, lse = ref.attention_forward(q, k, v)
    out_explicit, lse_explicit = ref.attention_forward(q, k, v, softmax_scale=12 ** -0.5)
    np.testing.assert_array_equal(out, out_explicit)
    np.testing.assert_array_equal(lse, lse_explicit)
    # A different scale really changes the result, in every variant alike.
    out_t, _ = ref.attention_forward_tiled(q, k, v, softmax_scale=1.3)
    out_n, lse_n = ref.attention_forward(q, k, v, softmax_scale=1.3)
    assert rel_error(out_t, out_n) < 1e-12 and rel_error(out_n, out) > 1e-3
    grads_t = ref.attention_backward_tiled(dout, q, k, v, out_n, lse_n, softmax_scale=1.3)
    for g_t, g in zip(grads_t, ref.attention_backward(dout, q, k, v, softmax_scale=1.3)):
        assert rel_error(g_t, g) < 1e-12


def test_accepts_low_precision_inputs():
    q, k, v, _ = random_inputs(43, 1, 8, 8, 2, 2, 8)
    out32, lse32 = ref.attention_forward(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    out64, lse64 = ref.attention_forward(*(x.astype(np.float32).astype(np.float64) for x in (q, k, v)))
    assert out32.dtype == np.float64 and lse32.dtype == np.float64
    np.testing.assert_array_equal(out32, out64)
    np.testing.assert_array_equal(lse32, lse64)


def test_rejects_bad_shapes():
    q, k, v, _ = random_inputs(47, 1, 4, 4, 3, 2, 8)  # 3 query heads, 2 kv heads
    with pytest.raises(ValueError):
        ref.attention_forward(q, k, v)
    q, k, v, _ = random_inputs(47, 1, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError):
        ref.attention_forward(q, k[..., :4], v)
    with pytest.raises(ValueError):
        ref.attention_forward(q[0], k[0], v[0])


# --- low-precision emulation -------------------------------------------------------------

def test_round_to_matches_numpy_float16_cast():
    rng = np.random.default_rng(51)
    # Values across fp16's whole range: subnormals, normals, near overflow, plus specials.
    x = rng.standard_normal(20000) * np.exp2(rng.uniform(-28, 17, 20000))
    specials = [0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.9, 65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
                1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-11 + 2.0**-40]
    x = np.concatenate([x, specials, np.negative(specials)])
    with np.errstate(over="ignore"):
        for source in (x, x.astype(np.float32)):
            rounded = ref.round_to(source, "float16")
            assert rounded.dtype == np.float32
            np.testing.assert_array_equal(rounded, source.astype(np.float16).astype(np.float32))
    assert np.isnan(ref.round_to(np.nan, np.float16))


def test_round_to_matches_ml_dtypes_bfloat16_cast():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(52)
    x = rng.standard_normal(20000) * np.exp2(rng.uniform(-140, 128, 20000))
    specials = [0.0, np.inf, 2.0**-133, 2.0**-134, 3 * 2.0**-135, 1 + 2.0**-8, 1 + 3 * 2.0**-8,
                float(np.finfo(np.float32).max), (2 - 2.0**-7) * 2.0**127]
    with np.errstate(over="ignore"):  # the largest random values overflow float32 on purpose
        x = np.concatenate([x, specials, np.negative(specials)]).astype(np.float32)
        expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    for dtype in ("bfloat16", ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16)):
        np.testing.assert_array_equal(ref.round_to(x, dtype), expected)
    # From float64, round_to rounds once; a cast through float32 would round this tie-breaker down.
    assert ref.round_to(1 + 2.0**-8 + 2.0**-30, "bfloat16") == 1 + 2.0**-7


def test_round_to_rejects_other_dtypes():
    with pytest.raises(ValueError):
        ref.round_to(1.0, "float32")


def representable(x, dtype):
    return np.array_equal(ref.round_to(x, dtype), x)


@pytest.mark.parametrize("causal", [False, True])
def test_lowp_forward_error_is_small_and_ordered(causal):
    q, k, v, _ = random_inputs(61 + causal, 2, 67, 53, 4, 2, 64)
    exact, _ = ref.attention_forward(q, k, v, causal=causal)
    errors = {}
    for dtype in ("float16", "bfloat16"):
        out = ref.attention_forward_lowp(q, k, v, dtype, causal=causal)
        assert out.dtype == np.float32 and out.shape == q.shape
        assert representable(out, dtype)
        errors[dtype] = rel_error(out, exact)
    assert 0 < errors["float16"] < errors["bfloat16"] < 1e-2
    assert errors["float16"] < 2e-3


@pytest.mark.parametrize("causal", [False, True])
def test_lowp_backward_error_is_small_and_ordered(causal):
    q, k, v, dout = random_inputs(71 + causal, 2, 67, 53, 4, 2, 64)
    exact = ref.attention_backward(dout, q, k, v, causal=causal)
    low = {dtype: ref.attention_backward_lowp(dout, q, k, v, dtype, causal=causal)
           for dtype in ("float16", "bfloat16")}
    for dtype, grads in low.items():
        for g, x in zip(grads, (q, k, v)):
            assert g.dtype == np.float32 and g.shape == x.shape
            assert representable(g, dtype)
    for g16, gbf, g in zip(low["float16"], low["bfloat16"], exact):
        assert 0 < rel_error(g16, g) < rel_error(gbf, g) < 3e-2


def test_lowp_with_exact_inputs_is_close_to_float64_and_accepts_dtype_objects():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v, dout = random_inputs(81, 1, 33, 33, 2, 1, 32)
    q, k, v, dout = (ref.round_to(x, "bfloat16") for x in (q, k, v, dout))
    out_str = ref.attention_forward_lowp(q, k, v, "bfloat16", causal=True)
    out_obj = ref.attention_forward_lowp(q.astype(ml_dtypes.bfloat16), k, v, ml_dtypes.bfloat16, causal=True)
    np.testing.assert_array_equal(out_str, out_obj)
    # Inputs already in bfloat16: only the intermediate roundings remain.
    exact, _ = ref.attention_forward(q, k, v, causal=True)
    assert 0 < rel_error(out_str, exact) < 1e-2
    grads_str = ref.attention_backward_lowp(dout, q, k, v, "bfloat16", causal=True)
    grads_obj = ref.attention_backward_lowp(dout, q, k, v, np.dtype(ml_dtypes.bfloat16), causal=True)
    for a, b in zip(grads_str, grads_obj):
        np.testing.assert_array_equal(a, b)
    f16 = ref.attention_forward_lowp(q, k, v, np.float16, causal=True)
    np.testing.assert_array_equal(f16, ref.attention_forward_lowp(q, k, v, "float16", causal=True))


# --- options: window_size, softcap, alibi_slopes, attn_bias --------------------------------

def make_options(seed, spec, batch, nheads, seqlen_q, seqlen_k):
    """Keyword arguments for the attention functions from a compact spec.

    spec keys: causal, window_size, softcap as is; alibi "h" for slopes (nheads,) or "bh" for
    (batch, nheads); bias a shape whose letters b, h, q, k stand for batch, nheads, seqlen_q,
    seqlen_k (1 broadcasts). Slopes and bias are fresh random values, never zeros.
    """
    rng = np.random.default_rng(seed)
    sizes = {"b": batch, "h": nheads, "q": seqlen_q, "k": seqlen_k, 1: 1}
    kwargs = {key: spec[key] for key in ("causal", "window_size", "softcap") if key in spec}
    if "alibi" in spec:
        kwargs["alibi_slopes"] = rng.uniform(0.05, 0.6, tuple(sizes[c] for c in spec["alibi"]))
    if "bias" in spec:
        kwargs["attn_bias"] = rng.standard_normal(tuple(sizes[c] for c in spec["bias"]))
    return kwargs


# (spec, (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim), (block_m, block_n));
# block sizes never divide the lengths.
OPTION_CASES = [
    ({"window_size": (3, 5)}, (1, 37, 29, 2, 2, 16), (16, 8)),
    ({"window_size": (0, 0)}, (2, 29, 29, 2, 1, 8), (8, 16)),
    ({"window_size": (4, -1)}, (1, 23, 41, 4, 2, 8), (16, 8)),  # seqlen_q < seqlen_k
    ({"window_size": (-1, 2)}, (1, 41, 23, 2, 2, 8), (8, 16)),  # seqlen_q > seqlen_k, empty rows
    ({"window_size": (6, 3), "causal": True}, (1, 41, 23, 4, 1, 8), (16, 8)),  # MQA, empty rows
    ({"window_size": (5, 2), "causal": True}, (2, 19, 37, 4, 2, 8), (8, 8)),  # GQA
    ({"softcap": 2.0}, (1, 37, 29, 2, 2, 16), (16, 8)),
    ({"softcap": 1.5, "causal": True}, (1, 29, 43, 4, 2, 16), (8, 16)),  # GQA
    ({"alibi": "h"}, (1, 37, 29, 4, 2, 16), (16, 8)),
    ({"alibi": "bh", "causal": True}, (2, 29, 37, 2, 1, 8), (8, 16)),
    ({"bias": "bhqk"}, (2, 29, 23, 2, 2, 8), (16, 8)),
    ({"bias": (1, "h", "q", "k")}, (2, 23, 29, 4, 2, 8), (8, 16)),
    ({"bias": ("b", 1, "q", "k"), "causal": True}, (2, 37, 29, 2, 1, 8), (16, 8)),
    ({"bias": (1, 1, 1, "k")}, (1, 23, 29, 2, 2, 8), (8, 8)),
    ({"window_size": (4, 1), "softcap": 1.0}, (1, 37, 37, 2, 2, 16), (16, 8)),
    ({"window_size": (2, 7), "alibi": "h"}, (1, 29, 41, 4, 1, 8), (8, 16)),
    ({"window_size": (3, 0), "bias": "bhqk"}, (2, 41, 29, 2, 2, 8), (16, 8)),
    ({"softcap": 3.0, "bias": (1, "h", "q", "k")}, (1, 29, 37, 4, 2, 16), (8, 16)),
    ({"softcap": 2.5, "alibi": "bh", "window_size": (-1, 4)}, (2, 23, 29, 2, 2, 8), (16, 8)),
    ({"alibi": "h", "bias": ("b", 1, "q", "k"), "causal": True}, (2, 37, 23, 4, 2, 8), (8, 16)),
    ({"window_size": (7, 2), "softcap": 2.0, "alibi": "bh", "bias": "bhqk", "causal": True},
     (2, 29, 37, 4, 2, 16), (16, 8)),
]


@pytest.mark.parametrize("case_index", range(len(OPTION_CASES)))
def test_tiled_matches_naive_with_options(case_index):
    spec, shape, (block_m, block_n) = OPTION_CASES[case_index]
    batch, seqlen_q, seqlen_k, nheads = shape[:4]
    q, k, v, dout = random_inputs(300 + case_index, *shape)
    opts = make_options(400 + case_index, spec, batch, nheads, seqlen_q, seqlen_k)
    out, lse = ref.attention_forward(q, k, v, **opts)
    out_t, lse_t = ref.attention_forward_tiled(q, k, v, block_m=block_m, block_n=block_n, **opts)
    assert rel_error(out_t, out) < 1e-12
    assert_lse_close(lse_t, lse, 1e-12)

    grads = ref.attention_backward(dout, q, k, v, return_dbias=True, **opts)
    grads_t = ref.attention_backward_tiled(dout, q, k, v, out, lse, block_m=block_m, block_n=block_n,
                                           return_dbias=True, **opts)
    for g, g_t, x in zip(grads[:3], grads_t[:3], (q, k, v)):
        assert g.shape == g_t.shape == x.shape
        assert np.isfinite(g_t).all()
        assert rel_error(g_t, g) < 1e-12
    if "attn_bias" in opts:
        assert grads[3].shape == grads_t[3].shape == opts["attn_bias"].shape
        assert rel_error(grads_t[3], grads[3]) < 1e-12
    else:
        assert grads[3] is None and grads_t[3] is None


def direct_attention_with_options(q, k, v, scale, window_size=(-1, -1), softcap=0.0, slopes=None, bias=None):
    """Loop-based attention with every option, straight from the documented transform order."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    left, right = window_size
    out = np.zeros(q.shape)
    for b in range(batch):
        for h in range(nheads):
            kv_head = h // (nheads // nheads_k)
            for i in range(seqlen_q):
                diag = i + seqlen_k - seqlen_q
                keys = [j for j in range(seqlen_k)
                        if (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)]
                if not keys:
                    continue
                logits = []
                for j in keys:
                    s = q[b, i, h] @ k[b, j, kv_head] * scale
                    if softcap:
                        s = softcap * np.tanh(s / softcap)
                    if slopes is not None:
                        s -= slopes[h] * abs(diag - j)
                    if bias is not None:
                        s += bias[b, h, i, j]
                    logits.append(s)
                weights = np.exp(np.array(logits) - max(logits))
                out[b, i, h] = (weights / weights.sum()) @ v[b, keys, kv_head]
    return out


def test_every_option_matches_direct_definition():
    q, k, v, _ = random_inputs(501, 2, 7, 9, 4, 2, 6)
    rng = np.random.default_rng(502)
    slopes = rng.uniform(0.1, 0.5, 4)
    bias = rng.standard_normal((2, 4, 7, 9))
    direct = direct_attention_with_options(q, k, v, 0.9, (3, 1), 1.2, slopes, bias)
    for forward in (ref.attention_forward, ref.attention_forward_tiled):
        out, _ = forward(q, k, v, 0.9, window_size=(3, 1), softcap=1.2, alibi_slopes=slopes, attn_bias=bias)
        assert rel_error(out, direct) < 1e-13
    # The softcap really applies before the bias: capping the bias too would give another result.
    wrong = direct_attention_with_options(q, k, v, 0.9, (3, 1), 1.2, None, None)
    assert rel_error(wrong, direct) > 1e-3


def test_alibi_equals_the_same_bias_given_as_attn_bias():
    batch, seqlen_q, seqlen_k, nheads = 2, 9, 6, 4
    q, k, v, dout = random_inputs(511, batch, seqlen_q, seqlen_k, nheads, 2, 8)
    slopes = np.random.default_rng(512).uniform(0.1, 1.0, (batch, nheads))
    i, j = np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :]
    bias = -slopes[:, :, None, None] * np.abs(i + seqlen_k - seqlen_q - j)
    for causal in (False, True):
        out_a, lse_a = ref.attention_forward(q, k, v, causal=causal, alibi_slopes=slopes)
        out_b, lse_b = ref.attention_forward(q, k, v, causal=causal, attn_bias=bias)
        assert rel_error(out_a, out_b) < 1e-14
        assert_lse_close(lse_a, lse_b, 1e-14)
        grads_a = ref.attention_backward(dout, q, k, v, causal=causal, alibi_slopes=slopes)
        grads_b = ref.attention_backward(dout, q, k, v, causal=causal, attn_bias=bias)
        for g_a, g_b in zip(grads_a, grads_b):
            assert rel_error(g_a, g_b) < 1e-13


# (seed, (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim), spec)
FD_CASES = [
    (601, (1, 4, 3, 2, 1, 3), {"softcap": 0.8}),
    (602, (2, 3, 5, 2, 2, 3), {"softcap": 1.3, "causal": True}),
    (603, (1, 4, 5, 2, 1, 3), {"alibi": "h"}),
    (604, (2, 5, 3, 2, 2, 3), {"alibi": "bh", "causal": True}),  # two empty rows
    (605, (1, 5, 5, 2, 2, 3), {"window_size": (1, 1)}),
    (606, (1, 4, 6, 2, 1, 3), {"window_size": (2, 0), "softcap": 1.0}),
    (607, (2, 3, 4, 2, 2, 3), {"bias": (1, "h", "q", "k")}),
    (608, (2, 4, 3, 2, 1, 3), {"bias": ("b", 1, "q", "k"), "causal": True}),
    (609, (1, 3, 4, 2, 2, 3), {"bias": "bhqk", "softcap": 0.9, "window_size": (1, 2)}),
]


@pytest.mark.parametrize("case_index", range(len(FD_CASES)))
def test_backward_with_options_matches_finite_differences(case_index):
    seed, shape, spec = FD_CASES[case_index]
    q, k, v, w = random_inputs(seed, *shape)
    opts = make_options(seed + 50, spec, shape[0], shape[3], shape[1], shape[2])
    scale = 0.7

    def loss():
        out, _ = ref.attention_forward(q, k, v, scale, **opts)
        return np.sum(out * w)

    analytic = ref.attention_backward(w, q, k, v, scale, return_dbias=True, **opts)
    for x, grad in zip((q, k, v), analytic):
        assert rel_error(grad, numerical_gradient(loss, x)) < 1e-6
    if "attn_bias" in opts:
        bias = opts["attn_bias"]  # perturbed in place, so loss() sees it
        assert analytic[3].shape == bias.shape
        assert rel_error(analytic[3], numerical_gradient(loss, bias)) < 1e-6


def test_visible_window_hand_checked_cases():
    # seqlen_q = seqlen_k = 6, window (2, 0): row i sees keys i - 2 .. i.
    mask = ref.visible(6, 6, False, window_size=(2, 0))
    assert np.flatnonzero(mask[3]).tolist() == [1, 2, 3]
    assert np.flatnonzero(mask[0]).tolist() == [0]
    assert np.flatnonzero(mask[5]).tolist() == [3, 4, 5]
    # seqlen_q = 3, seqlen_k = 5, window (1, 1): row i's diagonal is key i + 2.
    expected = np.array([[0, 1, 1, 1, 0],
                         [0, 0, 1, 1, 1],
                         [0, 0, 0, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(ref.visible(3, 5, False, window_size=(1, 1)), expected)
    # seqlen_q = 5, seqlen_k = 3, window (0, 1): row i sees keys i - 2 .. i - 1.
    expected = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 1], [0, 0, 1]], dtype=bool)
    np.testing.assert_array_equal(ref.visible(5, 3, False, window_size=(0, 1)), expected)
    # Causal intersects: right is cut to 0, left stays.
    np.testing.assert_array_equal(ref.visible(3, 5, True, window_size=(1, 1)),
                                  ref.visible(3, 5, False, window_size=(1, 0)))
    # A tile is the corresponding piece of the full matrix.
    full = ref.visible(37, 29, True, window_size=(5, 3))
    np.testing.assert_array_equal(ref.visible(37, 29, True, slice(16, 32), slice(8, 16), window_size=(5, 3)),
                                  full[16:32, 8:16])


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(6, 6), (4, 9), (9, 4)])
def test_window_limits_equal_causal_and_no_mask(seqlen_q, seqlen_k):
    np.testing.assert_array_equal(ref.visible(seqlen_q, seqlen_k, False, window_size=(-1, 0)),
                                  ref.visible(seqlen_q, seqlen_k, True))
    assert ref.visible(seqlen_q, seqlen_k, False, window_size=(-1, -1)).all()
    q, k, v, dout = random_inputs(seqlen_q * 7 + seqlen_k, 2, seqlen_q, seqlen_k, 2, 1, 8)
    # (window, causal with the window, causal of the plain attention it must equal)
    for window, with_causal, causal in (((-1, 0), False, True), ((-1, -1), False, False), ((-1, 5), True, True)):
        out_w, lse_w = ref.attention_forward(q, k, v, window_size=window, causal=with_causal)
        out_c, lse_c = ref.attention_forward(q, k, v, causal=causal)
        np.testing.assert_array_equal(out_w, out_c)
        np.testing.assert_array_equal(lse_w, lse_c)
        for g_w, g_c in zip(ref.attention_backward(dout, q, k, v, window_size=window, causal=with_causal),
                            ref.attention_backward(dout, q, k, v, causal=causal)):
            np.testing.assert_array_equal(g_w, g_c)


def test_window_rows_match_attention_over_their_keys():
    # seqlen_q = seqlen_k = 6, window (2, 0): row 3 is plain attention over keys 1..3.
    q, k, v, _ = random_inputs(521, 1, 6, 6, 2, 2, 4)
    out, lse = ref.attention_forward(q, k, v, window_size=(2, 0))
    row3, lse3 = ref.attention_forward(q[:, 3:4], k[:, 1:4], v[:, 1:4])
    np.testing.assert_allclose(out[:, 3:4], row3, rtol=1e-14)
    np.testing.assert_allclose(lse[..., 3], lse3[..., 0], rtol=1e-14)
    # seqlen_q = 3, seqlen_k = 5, window (1, 1): row 0 is attention over keys 1..3.
    q, k, v, _ = random_inputs(522, 1, 3, 5, 2, 1, 4)
    out, lse = ref.attention_forward(q, k, v, window_size=(1, 1))
    row0, lse0 = ref.attention_forward(q[:, :1], k[:, 1:4], v[:, 1:4])
    np.testing.assert_allclose(out[:, :1], row0, rtol=1e-14)
    np.testing.assert_allclose(lse[..., 0], lse0[..., 0], rtol=1e-14)


def test_block_ranges_hand_checked():
    # seqlen 64, window (8, 0), blocks of 16: rows 32..47 see keys 24..47, blocks 1 and 2.
    assert ref.key_block_range(slice(32, 48), 64, 64, 16, window_size=(8, 0)) == range(1, 3)
    assert ref.key_block_range(slice(0, 16), 64, 64, 16, window_size=(8, 0)) == range(0, 1)
    assert ref.key_block_range(slice(0, 16), 64, 64, 16, causal=True) == range(0, 1)
    assert ref.key_block_range(slice(0, 16), 64, 64, 16) == range(0, 4)
    # Keys 16..31 are seen by rows 16..39, query blocks 1 and 2.
    assert ref.query_block_range(slice(16, 32), 64, 64, 16, window_size=(8, 0)) == range(1, 3)
    # seqlen_q = 40 > seqlen_k = 8, causal: rows 0..31 see nothing.
    assert len(ref.key_block_range(slice(0, 16), 40, 8, 4, causal=True)) == 0
    assert ref.query_block_range(slice(0, 4), 40, 8, 16, causal=True) == range(2, 3)


@pytest.mark.parametrize("seqlen_q, seqlen_k, window, causal, block_m, block_n", [
    (64, 64, (8, 0), False, 16, 16),
    (61, 47, (5, 3), False, 8, 16),
    (29, 53, (-1, 2), True, 16, 8),
    (53, 29, (3, -1), False, 8, 8),
    (40, 8, (-1, -1), True, 16, 4),
])
def test_block_ranges_are_exact(seqlen_q, seqlen_k, window, causal, block_m, block_n):
    mask = ref.visible(seqlen_q, seqlen_k, causal, window_size=window)
    for m, rows in enumerate(ref._blocks(seqlen_q, block_m)):
        expected = [n for n, cols in enumerate(ref._blocks(seqlen_k, block_n)) if mask[rows, cols].any()]
        got = ref.key_block_range(rows, seqlen_q, seqlen_k, block_n, causal, window_size=window)
        assert list(got) == expected
    for n, cols in enumerate(ref._blocks(seqlen_k, block_n)):
        expected = [m for m, rows in enumerate(ref._blocks(seqlen_q, block_m)) if mask[rows, cols].any()]
        got = ref.query_block_range(cols, seqlen_q, seqlen_k, block_m, causal, window_size=window)
        assert list(got) == expected


def test_tiled_functions_skip_tiles_outside_the_window(monkeypatch):
    seqlen, block = 64, 16
    q, k, v, dout = random_inputs(531, 1, seqlen, seqlen, 2, 2, 8)
    visited = []
    monkeypatch.setattr(ref, "tile_hook", lambda pass_name, rows, cols: visited.append(
        (pass_name, rows.start // block, cols.start // block)))

    def tiles(pass_name, **opts):
        visited.clear()
        out, lse = ref.attention_forward_tiled(q, k, v, block_m=block, block_n=block, **opts)
        ref.attention_backward_tiled(dout, q, k, v, out, lse, block_m=block, block_n=block, **opts)
        return sorted((m, n) for name, m, n in visited if name == pass_name)

    assert len(tiles("forward")) == len(tiles("backward")) == 16
    assert len(tiles("forward", causal=True)) == 10
    # Window (8, 0): query block m sees key blocks m - 1 and m only.
    expected = [(0, 0)] + [(m, n) for m in range(1, 4) for n in (m - 1, m)]
    assert tiles("forward", window_size=(8, 0)) == tiles("backward", window_size=(8, 0)) == expected
    # Window (0, 0) is the diagonal alone: one tile per query block.
    assert tiles("forward", window_size=(0, 0)) == [(m, m) for m in range(4)]


def test_softcap_alibi_and_bias_limits_equal_plain_attention():
    batch, seqlen_q, seqlen_k, nheads = 2, 13, 11, 4
    q, k, v, dout = random_inputs(541, batch, seqlen_q, seqlen_k, nheads, 2, 16)
    for causal in (False, True):
        out, lse = ref.attention_forward(q, k, v, causal=causal)
        grads = ref.attention_backward(dout, q, k, v, causal=causal)
        # softcap * tanh(s / softcap) = s - s^3 / (3 softcap^2) + ...: a huge cap changes nothing.
        out_c, lse_c = ref.attention_forward_tiled(q, k, v, causal=causal, softcap=1e6, block_m=8, block_n=8)
        assert rel_error(out_c, out) < 1e-9
        assert_lse_close(lse_c, lse, 1e-9)
        for g_c, g in zip(ref.attention_backward(dout, q, k, v, causal=causal, softcap=1e6), grads):
            assert rel_error(g_c, g) < 1e-9
        # Zero slopes and a zero bias (the inputs themselves stay random) change nothing at all.
        zero_opts = {"alibi_slopes": np.zeros(nheads), "attn_bias": np.zeros((1, nheads, seqlen_q, seqlen_k))}
        out_z, lse_z = ref.attention_forward(q, k, v, causal=causal, **zero_opts)
        np.testing.assert_array_equal(out_z, out)
        np.testing.assert_array_equal(lse_z, lse)
        grads_z = ref.attention_backward(dout, q, k, v, causal=causal, return_dbias=True, **zero_opts)
        for g_z, g in zip(grads_z, grads):
            np.testing.assert_array_equal(g_z, g)
        assert grads_z[3].shape == (1, nheads, seqlen_q, seqlen_k) and np.abs(grads_z[3]).max() > 0
    # The options really do something when not at their limits.
    assert rel_error(ref.attention_forward(q, k, v, softcap=1.0)[0], out) > 1e-3


def test_window_empty_rows_give_zero_out_minus_inf_lse_and_zero_gradient():
    # seqlen_q = 8, seqlen_k = 5, window (1, 0): row i sees keys i - 4 .. i - 3, rows 0..2 none.
    q, k, v, dout = random_inputs(551, 2, 8, 5, 2, 1, 8)
    opts = {"window_size": (1, 0), "softcap": 2.0, "alibi_slopes": np.array([0.3, 0.7]),
            "attn_bias": np.random.default_rng(552).standard_normal((2, 1, 8, 5))}
    for forward in (ref.attention_forward, ref.attention_forward_tiled):
        out, lse = forward(q, k, v, **opts)
        assert (out[:, :3] == 0).all() and np.isfinite(out).all()
        assert np.isneginf(lse[:, :, :3]).all() and np.isfinite(lse[:, :, 3:]).all()

    out, lse = ref.attention_forward(q, k, v, **opts)
    naive = ref.attention_backward(dout, q, k, v, return_dbias=True, **opts)
    tiled = ref.attention_backward_tiled(dout, q, k, v, out, lse, block_m=3, block_n=2, return_dbias=True, **opts)
    # The empty rows must not influence dk, dv: they equal the gradients of rows 3..7 alone
    # (seqlen_q 5 keeps the same alignment of rows to keys).
    rest_opts = dict(opts, attn_bias=opts["attn_bias"][:, :, 3:])
    dk_rest, dv_rest = ref.attention_backward(dout[:, 3:], q[:, 3:], k, v, **rest_opts)[1:]
    for dq, dk, dv, dbias in (naive, tiled):
        assert all(np.isfinite(g).all() for g in (dq, dk, dv, dbias))
        assert (dq[:, :3] == 0).all() and (dbias[:, :, :3] == 0).all()
        np.testing.assert_allclose(dk, dk_rest, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(dv, dv_rest, rtol=1e-12, atol=1e-14)

    for dtype in ("float16", "bfloat16"):
        out_l, lse_l = ref.attention_forward_lowp(q, k, v, dtype, return_lse=True, **opts)
        assert (out_l[:, :3] == 0).all() and np.isneginf(lse_l[:, :, :3]).all()
        for grad in ref.attention_backward_lowp(dout, q, k, v, dtype, return_dbias=True, **opts):
            assert np.isfinite(grad).all()


LOWP_OPTION_SPECS = [
    {"window_size": (9, 4), "causal": True},
    {"softcap": 2.0, "alibi": "h"},
    {"window_size": (12, 6), "softcap": 3.0, "alibi": "bh", "bias": (1, "h", "q", "k")},
]


@pytest.mark.parametrize("spec_index", range(len(LOWP_OPTION_SPECS)))
def test_lowp_with_options_is_close_and_ordered(spec_index):
    spec = LOWP_OPTION_SPECS[spec_index]
    batch, seqlen_q, seqlen_k, nheads = 2, 37, 29, 4
    q, k, v, dout = random_inputs(561 + spec_index, batch, seqlen_q, seqlen_k, nheads, 2, 32)
    opts = make_options(571 + spec_index, spec, batch, nheads, seqlen_q, seqlen_k)
    exact_out, exact_lse = ref.attention_forward(q, k, v, **opts)
    exact_grads = ref.attention_backward(dout, q, k, v, return_dbias=True, **opts)
    errors = {}
    for dtype in ("float16", "bfloat16"):
        out, lse = ref.attention_forward_lowp(q, k, v, dtype, return_lse=True, **opts)
        assert representable(out, dtype)
        assert_lse_close(lse, exact_lse, 3e-2)
        grads = ref.attention_backward_lowp(dout, q, k, v, dtype, return_dbias=True, **opts)
        errors[dtype] = [rel_error(out, exact_out)]
        for g, g_exact in zip(grads, exact_grads):
            if g_exact is None:
                assert g is None
                continue
            assert g.shape == g_exact.shape and representable(g, dtype)
            errors[dtype].append(rel_error(g, g_exact))
    for e16, ebf in zip(errors["float16"], errors["bfloat16"]):
        assert 0 < e16 < ebf < 5e-2


def test_lowp_score_transform_rounds_every_step():
    # Every intermediate of the low-precision transform, the tanh included, is a dtype value.
    q, k, _, _ = random_inputs(585, 2, 9, 11, 2, 2, 16)
    rng = np.random.default_rng(586)
    qh, kh = (ref.round_to(x.transpose(0, 2, 1, 3), "float16") for x in (q, k))
    bias = rng.standard_normal((2, 2, 9, 11))
    mask = ref.visible(9, 11, False, window_size=(4, 3))
    s, t = ref.scaled_scores(qh, kh, 0.3, mask, lambda x: ref.round_to(x, "float16"), softcap=3.0,
                             bias=bias, return_tanh=True)
    assert s.dtype == t.dtype == np.float32
    assert representable(t, "float16") and representable(s[:, :, mask], "float16")
    assert np.isneginf(s[:, :, ~mask]).all()
    # Without rounding it is the float64 transform, which lies within float16's precision.
    s64, t64 = ref.scaled_scores(qh.astype(np.float64), kh.astype(np.float64), 0.3, mask, softcap=3.0,
                                 bias=bias, return_tanh=True)
    assert s64.dtype == np.float64 and 0 < rel_error(t, t64) < 2e-3
    assert 0 < rel_error(s[:, :, mask], s64[:, :, mask]) < 2e-3


def test_return_dbias_without_attn_bias_gives_none_and_default_returns_three():
    q, k, v, dout = random_inputs(581, 1, 5, 6, 2, 2, 8)
    out, lse = ref.attention_forward(q, k, v)
    assert len(ref.attention_backward(dout, q, k, v, attn_bias=np.ones((5, 6)))) == 3
    assert ref.attention_backward(dout, q, k, v, return_dbias=True)[3] is None
    assert ref.attention_backward_tiled(dout, q, k, v, out, lse, return_dbias=True)[3] is None
    assert ref.attention_backward_lowp(dout, q, k, v, "float16", return_dbias=True)[3] is None
    # A bias without batch and head axes broadcasts, and its gradient keeps its shape.
    bias = np.random.default_rng(582).standard_normal((5, 6))
    dbias = ref.attention_backward(dout, q, k, v, attn_bias=bias, return_dbias=True)[3]
    full = ref.attention_backward(dout, q, k, v, attn_bias=np.broadcast_to(bias, (1, 2, 5, 6)),
                                  return_dbias=True)[3]
    assert dbias.shape == (5, 6)
    np.testing.assert_allclose(dbias, full.sum(axis=(0, 1)), rtol=1e-13, atol=1e-15)


def reference_calls(q, k, v, dout, options):
    """Every dense reference function called with `options`, each as a thunk (for the argument checks)."""
    out, lse = ref.attention_forward(q, k, v)
    return [
        lambda: ref.attention_forward(q, k, v, **options),
        lambda: ref.attention_backward(dout, q, k, v, **options),
        lambda: ref.attention_forward_tiled(q, k, v, **options),
        lambda: ref.attention_backward_tiled(dout, q, k, v, out, lse, **options),
        lambda: ref.attention_forward_lowp(q, k, v, "float16", **options),
        lambda: ref.attention_backward_lowp(dout, q, k, v, "bfloat16", **options),
    ]


@pytest.mark.parametrize("options, message", [
    ({"window_size": (-2, 0)}, r"window_size entries must be >= -1 .* got \(-2, 0\)"),
    ({"window_size": (3, -5)}, r"window_size entries must be >= -1 .* got \(3, -5\)"),
    ({"window_size": (1, 2, 3)}, r"window_size must be a pair .* got \(1, 2, 3\)"),
    ({"window_size": (1.5, 2)}, r"window_size must be a pair .* got \(1.5, 2\)"),
    ({"softcap": -1.0}, r"softcap must be a finite number >= 0 .* got -1.0"),
    ({"softcap": float("nan")}, r"softcap must be a finite number >= 0 .* got nan"),
    ({"softcap": "big"}, r"softcap must be a finite number >= 0 .* got 'big'"),
    ({"alibi_slopes": np.full(2, 0.5)}, r"alibi_slopes must have shape \(4,\) or \(2, 4\), got \(2,\)"),
    ({"alibi_slopes": np.full((2, 4, 1), 0.5)}, r"alibi_slopes must have shape .* got \(2, 4, 1\)"),
    ({"attn_bias": np.ones((2, 4, 5, 7))},
     r"attn_bias must broadcast to .* \(2, 4, 5, 6\), got shape \(2, 4, 5, 7\)"),
    ({"attn_bias": np.ones((3, 1, 5, 6))}, r"attn_bias must broadcast .* got shape \(3, 1, 5, 6\)"),
    ({"attn_bias": np.ones((1, 2, 4, 5, 6))}, r"attn_bias must broadcast .* got shape \(1, 2, 4, 5, 6\)"),
])
def test_rejects_bad_options(options, message):
    q, k, v, dout = random_inputs(591, 2, 5, 6, 4, 2, 8)
    for call in reference_calls(q, k, v, dout, options):
        with pytest.raises(ValueError, match=message):
            call()
    if "window_size" in options:
        with pytest.raises(ValueError, match=message):
            ref.visible(5, 6, False, window_size=options["window_size"])
