"""cupyflash.jax, the options on XLA's CPU backend: each entry of the option matrix (tests/option_cases.py)
against the float64 reference, eager and under jit (the handlers run the reference on the float32
buffers and round once, so these check the plumbing at float32 roundoff: which attribute and
operand reach which argument, the seed's words, dbias's routing to attn_bias); window, ALiBi and
attn_bias against jax.nn.dot_product_attention; the dropout seed as a traced operand; option checks.
(The test_jax_*.py files are split by concern; test_jax_grad.py lists them.)
"""

import functools
import os
import re

import numpy
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
pytest.register_assert_rewrite("jax_helpers")

from cupyflash import reference  # noqa: E402
from cupyflash.jax import flash_attn, forward_with_lse  # noqa: E402
from jax_helpers import (OPTION_SHAPES, OPTIONS, _assert_close, _assert_rounded, _f64, _make_options,  # noqa: E402
                         _mask_and_bias, _random, _reference_options, _vjp_with_options, on_cpu)  # noqa: F401


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("shape", OPTION_SHAPES, ids=lambda s: "b{}_sq{}_sk{}_h{}/{}_d{}{}".format(*s[:6], "_causal" * s[6]))
@pytest.mark.parametrize("name", OPTIONS)
def test_cpu_options_match_reference(on_cpu, name, shape, jit):
    batch, sq, sk, h, hk, d, causal = shape
    q, k, v = _random((batch, sq, h, d), 20), _random((batch, sk, hk, d), 21), _random((batch, sk, hk, d), 22)
    dout = _random((batch, sq, h, d), 23)
    options = _make_options(OPTIONS[name], shape, 24)
    attention = functools.partial(flash_attn, softmax_scale=0.3, causal=causal)
    out, (dq, dk, dv, d_arrays) = _vjp_with_options(attention, q, k, v, dout, options, jit)
    _, lse = forward_with_lse(q, k, v, 0.3, causal, **options)

    ref_options = _reference_options(options)
    args = [_f64(x) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention_forward(*args, 0.3, causal, **ref_options)
    ref_grads = reference.attention_backward(_f64(dout), *args, 0.3, causal, return_dbias=True, **ref_options)
    for what, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), (ref_out, ref_lse, *ref_grads)):
        _assert_rounded(what, got, ref)
    if "attn_bias" in options:
        assert d_arrays["attn_bias"].dtype == options["attn_bias"].dtype
        _assert_rounded("dbias", d_arrays["attn_bias"], ref_grads[3])
    if "alibi_slopes" in options:  # ALiBi's slopes are constants: a zero cotangent
        assert not numpy.asarray(d_arrays["alibi_slopes"]).any()
    if "dropout_seed" in d_arrays:
        assert d_arrays["dropout_seed"].dtype == jax.dtypes.float0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), (3, 1), (0, 4)], ids=str)
def test_cpu_window_alibi_bias_match_dot_product_attention(on_cpu, window, causal):
    """Window and causal as jax.nn's mask, ALiBi plus attn_bias as its bias, whose gradient is attn_bias's;
    under jit, with jax.grad of a nonlinear loss. Every row sees a key."""
    batch, sq, sk, h, hk, d = 2, 9, 12, 4, 2, 16
    q, k, v = _random((batch, sq, h, d), 25), _random((batch, sk, hk, d), 26), _random((batch, sk, hk, d), 27)
    options = _make_options(dict(alibi_slopes="batch", attn_bias="heads"), (batch, sq, sk, h), 28)
    slopes, bias = options["alibi_slopes"], options["attn_bias"]

    def ours(q, k, v, bias):
        return flash_attn(q, k, v, 0.3, causal, window_size=window, alibi_slopes=slopes, attn_bias=bias)

    def theirs(q, k, v, bias):
        mask, full_bias = _mask_and_bias(sq, sk, causal, window, slopes, bias)
        return jax.nn.dot_product_attention(q, k, v, bias=full_bias, mask=mask, scale=0.3, implementation="xla")

    def loss(attention, *args):
        return jnp.sum(jnp.sin(attention(*args)))

    got = jax.jit(jax.value_and_grad(functools.partial(loss, ours), (0, 1, 2, 3)))(q, k, v, bias)
    want = jax.value_and_grad(functools.partial(loss, theirs), (0, 1, 2, 3))(q, k, v, bias)
    _assert_close("loss", got[0], want[0])
    for name, x, y in zip(("dq", "dk", "dv", "dbias"), got[1], want[1]):
        _assert_close(name, x, y)


def test_cpu_dropout_seed_is_traced(on_cpu):
    """One jitted program for every seed: a new seed gives a new mask without a retrace; the same seed
    (as an array or as the int of its words) the same result; the lse does not depend on dropout."""
    q, k, v = _random((1, 9, 2, 16), 29), _random((1, 11, 2, 16), 30), _random((1, 11, 2, 16), 31)
    traces = []

    @jax.jit
    def attention(q, k, v, seed):
        traces.append(seed)
        return forward_with_lse(q, k, v, causal=True, dropout_p=0.4, dropout_seed=seed)

    seeds = [jnp.asarray([1, 2], jnp.uint32), jnp.asarray([1, 2], jnp.uint32), jnp.asarray([1, 3], jnp.uint32)]
    (out1, lse1), (out2, lse2), (out3, lse3) = (attention(q, k, v, s) for s in seeds)
    assert len(traces) == 1
    assert numpy.array_equal(out1, out2) and not numpy.array_equal(out1, out3)
    assert numpy.array_equal(lse1, lse3)
    by_int, _ = forward_with_lse(q, k, v, causal=True, dropout_p=0.4, dropout_seed=1 | 2 << 32)
    assert numpy.array_equal(out1, by_int)
    plain, _ = forward_with_lse(q, k, v, causal=True)
    assert not numpy.array_equal(out1, plain)


def test_cpu_dbias_only_when_the_bias_is_differentiated(on_cpu):
    """The backward computes dbias only when attn_bias is differentiated (custom_vjp's `perturbed`):
    not for a constant bias, a bias outside argnums or under stop_gradient; dq is the same either way."""
    q = _random((2, 9, 4, 16), 50)
    bias = _random((4, 9, 9), 51)

    def loss(q, bias, stop=False):
        return jnp.sum(jnp.sin(flash_attn(q, q, q, 0.3, True, attn_bias=jax.lax.stop_gradient(bias) if stop else bias)))

    def backward_attributes(function, *args):
        hlo = jax.jit(function).lower(*args).as_text()
        return re.search(r"custom_call @cupyflash_flash_attn_bwd\(.*?mhlo.backend_config = \{(.*?)\}", hlo).group(1)

    both = jax.grad(loss, argnums=(0, 1))
    assert "return_dbias = true" in backward_attributes(both, q, bias)
    dq, dbias = jax.jit(both)(q, bias)
    _assert_close("dbias", dbias, jax.grad(lambda b: jnp.sum(jnp.sin(_attention_with_bias(q, b))))(bias))
    without = {"argnums": jax.grad(loss), "constant": jax.grad(lambda q: loss(q, bias)),
               "stop_gradient": jax.grad(functools.partial(loss, stop=True), argnums=(0, 1))}
    for name, function in without.items():
        args = (q,) if name == "constant" else (q, bias)
        assert "has_attn_bias = true" in backward_attributes(function, *args), name
        assert "return_dbias" not in backward_attributes(function, *args), name
        got = jax.jit(function)(*args)
        assert numpy.array_equal(got[0] if name == "stop_gradient" else got, dq), name
        if name == "stop_gradient":
            assert not numpy.asarray(got[1]).any()


def _attention_with_bias(q, bias):
    mask, full_bias = _mask_and_bias(9, 9, True, (-1, -1), jnp.zeros(4), bias)
    return jax.nn.dot_product_attention(q, q, q, bias=full_bias, mask=mask, scale=0.3, implementation="xla")


def test_cpu_backward_of_a_symbolic_zero(on_cpu):
    """A symbolic zero cotangent (symbolic_zeros=True) gives zero cotangents without a custom call."""
    from cupyflash import jax as cfjax
    q = _random((1, 8, 2, 16), 52)
    static, operands = cfjax._prepare(q, q, q, None, False, {}, "flash_attn")
    zero = jax.custom_derivatives.SymbolicZero.from_primal_value(q)
    assert cfjax._flash_attn_bwd(static, (q, q, q, operands, q, None, cfjax._Gradients(())), zero) == \
        (None, None, None, {})


@pytest.mark.parametrize("options, error, match", [
    (dict(alibi_slopes=jnp.ones(2, jnp.float16)), TypeError, "alibi_slopes must have dtype float32"),
    (dict(alibi_slopes=jnp.ones(3, jnp.float32)), ValueError, "alibi_slopes must have shape"),
    (dict(attn_bias=jnp.ones((3, 8, 8), jnp.float32)), ValueError, "attn_bias must broadcast"),
    (dict(attn_bias=[[0.0]]), TypeError, "attn_bias must be an array"),
    (dict(window_size=(8,)), ValueError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(dropout_p=0.1), ValueError, "dropout_seed is required"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, r"dropout_seed must be in \[0, 2\*\*64\)"),
    (dict(dropout_p=0.1, dropout_seed=jnp.ones(2, jnp.int32)), TypeError, "dropout_seed must be a uint32 array"),
    (dict(dropout_p=0.1, dropout_seed=jnp.ones(3, jnp.uint32)), TypeError, "dropout_seed must be a uint32 array"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_option_values_are_refused(on_cpu, options, error, match):
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(error, match=match):
        jax.jit(lambda q: flash_attn(q, q, q, **options))(q)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        forward_with_lse(q, q, q, window=(1, 1))
