"""cupyflash.torch, the drop-in's options: window_size, softcap, alibi_slopes, attn_bias (cupyflash's own),
dropout_p and deterministic, on CPU tensors. The ops run the float64 NumPy reference there, so the
comparisons with it check the plumbing (which option reaches which argument, which seed the
backward gets, which gradient autograd hands back); SDPA checks the mathematics independently of
the reference where it can express the options. The matrix of options is tests/option_cases.py.
(The test_torch_*.py files are split by concern; test_torch_autograd.py lists them.)
"""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("torch_helpers")

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cupyflash.torch as cft  # noqa: E402
from cupyflash import reference  # noqa: E402
from torch_helpers import (OPTION_SHAPES, OPTIONS, RESULT_NAMES, _assert_matches, _causal_call,  # noqa: E402
                           _dropin, _ids, _inputs, _make_options, _max_error, _numpy, _reference_options)


def _reference(q, k, v, dout, softmax_scale, causal, options, seed):
    """[out, lse, dq, dk, dv, dbias] of the float64 reference."""
    args = [_numpy(x) for x in (q, k, v)]
    opts = _reference_options(options, seed)
    out, lse = reference.attention_forward(*args, softmax_scale, causal, **opts)
    return [out, lse, *reference.attention_backward(_numpy(dout), *args, softmax_scale, causal, return_dbias=True,
                                                     **opts)]


@pytest.mark.parametrize("shape", OPTION_SHAPES, ids=_ids)
@pytest.mark.parametrize("name", OPTIONS)
def test_cpu_options_match_reference(name, shape):
    q, k, v, dout = _inputs(shape, torch.float64, "cpu", seed=20)
    causal = shape[-1]
    options = _make_options(OPTIONS[name], shape, torch.float64, "cpu", seed=21)
    got, seed = _dropin(_causal_call(cft.flash_attn_func, 0.3, causal), q, k, v, dout, options, torch_seed=22)
    assert (seed is None) == (not options.get("dropout_p"))
    _assert_matches(got, _reference(q, k, v, dout, 0.3, causal, options, seed))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_low_precision_with_options(dtype):
    """Tensors of other dtypes with every option: the float64 result rounded once to the dtype (dbias to
    attn_bias's dtype, here q's)."""
    shape = OPTION_SHAPES[1]
    q, k, v, dout = _inputs(shape, dtype, "cpu", seed=23)
    options = _make_options(OPTIONS["all"], shape, dtype, "cpu", seed=24)
    got, seed = _dropin(_causal_call(cft.flash_attn_func, None, True), q, k, v, dout, options)
    assert all(x.dtype == dtype for x in got[:1] + got[2:])
    _assert_matches(got, _reference(q, k, v, dout, None, True, options, seed))


def sdpa_masked(q, k, v, softmax_scale, mask):
    """SDPA's math backend in flash_attn's layout, kv heads repeated, with an additive float mask."""
    h = q.shape[2]
    k, v = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, scale=softmax_scale).transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), (3, 1), (0, 4)], ids=str)
def test_cpu_window_alibi_bias_match_sdpa(window, causal):
    """Window and causal masks, ALiBi and attn_bias as one SDPA attn_mask (float64), which also gives
    attn_bias's gradient; every row sees a key (SDPA would give NaN otherwise)."""
    shape = (2, 9, 12, 4, 2, 16, causal)
    b, sq, sk, h = shape[:4]
    q, k, v, dout = _inputs(shape, torch.float64, "cpu", seed=25)
    options = _make_options(dict(window_size=window, alibi_slopes="batch", attn_bias="heads"), shape,
                            torch.float64, "cpu", seed=26)
    got, _ = _dropin(_causal_call(cft.flash_attn_func, 0.3, causal), q, k, v, dout, options)

    visible = torch.from_numpy(reference.visible(sq, sk, causal, window_size=window))
    distance = (torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)).abs()
    alibi = -options["alibi_slopes"].double()[:, :, None, None] * distance
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, options["attn_bias"])]
    out = sdpa_masked(*leaves[:3], 0.3, (leaves[3] + alibi).masked_fill(~visible, -math.inf))
    ref = [out, *torch.autograd.grad(out, leaves, dout)]
    for name, x, r in zip(("out", "dq", "dk", "dv", "dbias"), got[:1] + got[2:], ref):
        assert x.shape == r.shape, name
        assert _max_error(x, r) <= 1e-12 * (1 + r.abs().max().item()), name


def test_cpu_dropout_follows_torch_manual_seed():
    shape = (1, 9, 11, 2, 2, 16, True)
    q, k, v, dout = _inputs(shape, torch.float64, "cpu", seed=29)
    call = _causal_call(cft.flash_attn_func, None, True)
    (first, seed_first), (again, seed_again), (other, seed_other) = (
        _dropin(call, q, k, v, dout, dict(dropout_p=0.4), torch_seed=s) for s in (1, 1, 2))
    plain, _ = _dropin(call, q, k, v, dout, {}, torch_seed=1)
    assert seed_first == seed_again != seed_other
    for name, x, y, z, p in zip(RESULT_NAMES, first, again, other, plain):
        if name == "dbias":
            continue
        assert torch.equal(x, y), name
        if name == "lse":  # the log-sum-exp of the scores, before dropout
            assert torch.equal(x, z) and torch.equal(x, p)
        else:
            assert not torch.equal(x, z) and not torch.equal(x, p), name
    # Without dropout no seed is drawn: torch's generator is left as it was.
    torch.manual_seed(3)
    cft.flash_attn_func(q, k, v, causal=True)
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4))
