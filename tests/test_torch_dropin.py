"""cupyflash.torch as a drop-in for flash_attn 2.x: the functions' signatures and defaults, the packed
(qkv, kv) forms against separate q, k, v, and the options' argument checks.
(The test_torch_*.py files are split by concern; test_torch_autograd.py lists them.)
"""

import numpy
import pytest

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("torch_helpers")

import cupyflash.torch as cft  # noqa: E402
from torch_helpers import _inputs, _max_error, _run  # noqa: E402


def test_packed_inputs_match_separate_ones():
    q, k, v, dout = _inputs((2, 19, 19, 4, 4, 16, True), torch.float64, "cpu", seed=5)
    ref = _run(lambda q, k, v: cft.flash_attn_func(q, k, v, causal=True), q, k, v, dout)
    qkv = torch.stack([q, k, v], dim=2).requires_grad_()
    out = cft.flash_attn_qkvpacked_func(qkv, causal=True)
    (out * dout).sum().backward()
    for x, r in zip([out, *qkv.grad.unbind(2)], ref):
        assert _max_error(x, r) <= 1e-12
    kv = torch.stack([k, v], dim=2).requires_grad_()
    qq = q.clone().requires_grad_()
    out = cft.flash_attn_kvpacked_func(qq, kv, causal=True)
    (out * dout).sum().backward()
    for x, r in zip([out, qq.grad, *kv.grad.unbind(2)], ref):
        assert _max_error(x, r) <= 1e-12


def test_bad_options_are_refused_with_their_names():
    q, k, v, _ = _inputs((1, 8, 8, 2, 2, 16, False), torch.float32, "cpu", seed=8)
    cases = [(TypeError, "alibi_slopes must be a torch.Tensor", dict(alibi_slopes=[0.5, 0.25])),
             (TypeError, "alibi_slopes must have dtype float32", dict(alibi_slopes=torch.ones(2, dtype=torch.float64))),
             (ValueError, "alibi_slopes must have shape", dict(alibi_slopes=torch.ones(3))),
             (TypeError, "attn_bias must be a torch.Tensor", dict(attn_bias=numpy.zeros((8, 8)))),
             (ValueError, "attn_bias must broadcast", dict(attn_bias=torch.zeros(3, 8, 8))),
             (ValueError, "window_size", dict(window_size=(8,))),
             (ValueError, "window_size", dict(window_size=(-2, 0))),
             (ValueError, "softcap", dict(softcap=-1.0)),
             (TypeError, "softcap must be a number", dict(softcap="1")),
             (ValueError, "dropout_p", dict(dropout_p=1.0)),
             (TypeError, "deterministic must be a bool", dict(deterministic=1))]
    for error, match, options in cases:
        with pytest.raises(error, match=match):
            cft.flash_attn_func(q, k, v, **options)
    for name, value in (("q", None), ("k", 3), ("v", numpy.zeros((1, 8, 2, 16), numpy.float32))):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got"):
            cft.flash_attn_func(**dict(dict(q=q, k=k, v=v), **{name: value}))


def test_options_at_their_defaults_are_accepted():
    q, k, v, _ = _inputs((1, 8, 8, 2, 2, 16, False), torch.float64, "cpu", seed=9)
    plain = cft.flash_attn_func(q, k, v)
    spelled = cft.flash_attn_func(q, k, v, 0.0, None, False, [-1, -1], 0.0, None, False, False, attn_bias=None)
    assert torch.equal(plain, spelled)


FLASH_ATTN_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                      ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]


@pytest.mark.parametrize("function,leading,extra", [
    ("flash_attn_func", ["q", "k", "v"], [("attn_bias", None)]),
    ("flash_attn_qkvpacked_func", ["qkv"], [("attn_bias", None)]),
    ("flash_attn_kvpacked_func", ["q", "kv"], [("attn_bias", None)]),
    ("flash_attn_varlen_func", ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
     [("block_table", None)]),
    ("flash_attn_varlen_qkvpacked_func", ["qkv", "cu_seqlens", "max_seqlen"], []),
    ("flash_attn_varlen_kvpacked_func", ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"], []),
])
def test_drop_in_signatures_match_flash_attn(function, leading, extra):
    """The parameters of flash_attn 2.x's functions, in order, with its defaults; cupyflash's attn_bias
    comes after them and only by keyword."""
    import inspect
    parameters = list(inspect.signature(getattr(cft, function)).parameters.values())
    expected = [(name, inspect.Parameter.empty) for name in leading] + FLASH_ATTN_OPTIONS + extra
    assert [(p.name, p.default) for p in parameters] == expected
    for p in parameters:
        assert (p.kind == p.KEYWORD_ONLY) == (p.name == "attn_bias"), p.name
