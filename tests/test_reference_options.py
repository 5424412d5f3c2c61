"""CPU tests of the reference's options (window_size, softcap, alibi_slopes, attn_bias): tiled against
naive, the definition, finite differences (dbias included), their limits, rows a window leaves
empty, return_dbias, and the argument checks.
(The reference's test files by concern: see test_reference.py.)
"""

import numpy as np
import pytest

from cupyflash import reference as ref

pytest.register_assert_rewrite("reference_helpers")
from reference_helpers import (assert_lse_close, make_options, numerical_gradient, random_inputs,  # noqa: E402
                               reference_calls, rel_error)


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


@pytest.mark.parametrize("options, message", [
    ({"window_size": (-2, 0)}, r"window_size entries must be >= -1 .* got \(-2, 0\)"),
    ({"window_size": (3, -5)}, r"window_size entries must be >= -1 .* got \(3, -5\)"),
    ({"window_size": (1, 2, 3)}, r"window_size must be a pair .* got \(1, 2, 3\)"),
    ({"window_size": (1.5, 2)}, r"window_size must be a pair .* got \(1.5, 2\)"),
    ({"softcap": -1.0}, r"softcap must be a finite number >= 0 .* got -1.0"),
    ({"softcap": float("nan")}, r"softcap must be a finite number >= 0 .* got nan"),
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


def test_rejects_options_that_are_not_numbers():
    q, k, v, dout = random_inputs(592, 2, 5, 6, 4, 2, 8)
    for call in reference_calls(q, k, v, dout, {"softcap": "big"}):
        with pytest.raises(TypeError, match=r"softcap must be a finite number >= 0 .* got 'big'"):
            call()
