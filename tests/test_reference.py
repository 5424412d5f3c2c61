"""CPU tests of the NumPy reference (the cupyflash/reference package): the tiled functions against the naive ones,
both against the definition and finite differences, GQA, the causal mask's alignment, rows that
see no key, the scale, input dtypes and shape checks.
(The reference's CPU tests are split by concern: test_reference (naive against tiled and against the
definition, finite differences, causal, scale, shapes), test_reference_masks (window masks and
block ranges), test_reference_options (softcap, ALiBi, attn_bias), test_reference_lowp (the
low-precision emulation) and test_reference_variants (Philox dropout and varlen); helpers in
reference_helpers.py.)
"""

import numpy as np
import pytest

from cupyflash import reference as ref

pytest.register_assert_rewrite("reference_helpers")
from reference_helpers import assert_lse_close, numerical_gradient, random_inputs, rel_error  # noqa: E402


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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_a_nan_key_reaches_exactly_the_rows_that_see_it(causal, softcap):
    # batch 2, 7 rows and keys, query heads 0 and 1 on kv head 0: key 4 of batch 1, kv head 0 is NaN.
    q, k, v, _ = random_inputs(5, 2, 7, 7, 4, 2, 8)
    k[1, 4, 0, 3] = np.nan
    expected = np.zeros((2, 7, 4), bool)
    expected[1, 4 if causal else 0:, :2] = True
    for forward in (ref.attention_forward, ref.attention_forward_tiled):
        out = forward(q, k, v, causal=causal, softcap=softcap)[0]
        nan = np.isnan(out)
        assert (nan.all(axis=-1) == expected).all() and (nan.any(axis=-1) == expected).all()


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
