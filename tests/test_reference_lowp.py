"""CPU tests of the reference's low-precision emulation (attention_*_lowp, round_to): rounding equals
NumPy's and ml_dtypes' casts, the errors are small and ordered (float16 below bfloat16), with the
options too, and every step of the score transform is rounded.
(The reference's test files by concern: see test_reference.py.)
"""

import numpy as np
import pytest

from cupyflash import reference as ref

pytest.register_assert_rewrite("reference_helpers")
from reference_helpers import (assert_lse_close, make_options, random_inputs, rel_error,  # noqa: E402
                               representable)


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


def test_the_checks_score_shift_raises_every_score_of_even_rows_and_lowers_odd_rows():
    """_check.Case(score_shift=...): the GPU checks' inputs for softcap's far ends (tests/test_gpu.py)."""
    from cupyflash import _check
    case = _check.Case(17, 113, 40, "bfloat16", False, batch=1, nheads=2, nheads_k=1, score_shift=400.0, softcap=30.0)
    inputs = _check.random_inputs(case, 7)
    q, k = (inputs[name].astype(np.float64) for name in "qk")
    assert all(np.array_equal(x, ref.round_to(x, "bfloat16")) for x in (q, k))
    scores = np.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) * 40 ** -0.5
    assert (scores[:, :, 0::2] > 300).all() and (scores[:, :, 1::2] < -300).all()
    assert np.tanh(np.abs(scores) / 30).min() > 0.999  # every capped score near +-cap
