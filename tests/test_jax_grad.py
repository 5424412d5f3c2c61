"""cupyflash.jax, the custom_vjp function eager and under jit: out, lse and the vjp against
jax.nn.dot_product_attention in float32 on XLA's CPU backend (where the FFI targets call the NumPy
reference), grad of a jitted loss, vmap, and the trace-time checks of shapes and options.

The JAX tests are split by concern, one file each: test_jax_ffi (the typed FFI: ctypes structures,
custom calls, attributes, handler errors), test_jax_grad, test_jax_options (the options and the
dropout seed), test_jax_varlen, test_jax_kvcache (flash_attn_with_kvcache), test_jax_ring (ring
attention under shard_map), test_jax_gpu (marked
`gpu`: the CUDA kernels on XLA's stream under cupyflash/_check.py's rule), test_jax_graphs (marked
`gpu`: the custom calls inside XLA's command buffers, CUDA graphs replayed) and test_jax_model (a small
transformer trained under jit); their helpers are in jax_helpers.py.
"""

import functools
import os

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
pytest.register_assert_rewrite("jax_helpers")

from cupyflash.jax import flash_attn, forward_with_lse  # noqa: E402
from jax_helpers import (_assert_close, _bottom_right_mask, _jax_attention, _random, on_cpu)  # noqa: E402, F401


CPU_SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal)
    (2, 17, 17, 4, 4, 40, False), (2, 17, 17, 4, 4, 40, True),
    (1, 113, 113, 2, 2, 64, True), (2, 17, 113, 6, 2, 40, True), (2, 17, 113, 6, 2, 40, False),
    (1, 113, 17, 4, 1, 32, False), (1, 1, 17, 2, 1, 8, True), (3, 33, 33, 3, 1, 24, True)]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "b{}_sq{}_sk{}_h{}/{}_d{}{}".format(*s[:6], "_causal" * s[6]))
def test_cpu_matches_dot_product_attention(on_cpu, shape, jit):
    batch, sq, sk, h, hk, d, causal = shape
    q, k, v = _random((batch, sq, h, d), 1), _random((batch, sk, hk, d), 2), _random((batch, sk, hk, d), 3)
    dout = _random((batch, sq, h, d), 4)
    scale = d ** -0.5
    ours = functools.partial(flash_attn, causal=causal)
    theirs = functools.partial(_jax_attention, scale=scale, causal=causal)
    if jit:
        ours, theirs = jax.jit(ours), jax.jit(theirs)
    out, vjp = jax.vjp(ours, q, k, v)
    ref, ref_vjp = jax.vjp(theirs, q, k, v)
    _assert_close("out", out, ref)
    for name, got, want in zip(("dq", "dk", "dv"), vjp(dout), ref_vjp(dout)):
        _assert_close(name, got, want)


def test_cpu_grad_of_a_jitted_loss_with_softmax_scale(on_cpu):
    q, k, v = _random((2, 29, 4, 16), 5), _random((2, 41, 2, 16), 6), _random((2, 41, 2, 16), 7)

    def loss(attention, q, k, v):
        return jnp.sum(jnp.sin(attention(q, k, v)))  # a nonlinear loss: dout is not constant

    ours = jax.jit(jax.value_and_grad(functools.partial(loss, lambda *a: flash_attn(*a, 0.7, True)), (0, 1, 2)))
    theirs = jax.value_and_grad(functools.partial(loss, lambda *a: _jax_attention(*a, 0.7, True)), (0, 1, 2))
    (value, grads), (ref_value, ref_grads) = ours(q, k, v), theirs(q, k, v)
    _assert_close("loss", value, ref_value)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _assert_close(name, got, want)


def test_cpu_lse(on_cpu):
    q, k, v = _random((1, 23, 2, 32), 8), _random((1, 31, 2, 32), 9), _random((1, 31, 2, 32), 10)
    out, lse = jax.jit(functools.partial(forward_with_lse, causal=True))(q, k, v)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 32 ** -0.5
    scores = jnp.where(_bottom_right_mask(23, 31), scores, -jnp.inf)
    assert lse.dtype == jnp.float32 and lse.shape == (1, 2, 23)
    _assert_close("lse", lse, jax.nn.logsumexp(scores, axis=-1))


def test_cpu_vmap_over_an_extra_axis(on_cpu):
    q = _random((3, 2, 9, 2, 8), 11)
    got = jax.vmap(functools.partial(flash_attn, causal=True))(q, q, q)
    for i in range(3):
        _assert_close(f"slice {i}", got[i], _jax_attention(q[i], q[i], q[i], 8 ** -0.5, True))


@pytest.mark.parametrize("args, error, match", [
    (((1, 8, 2, 16), (1, 8, 2), (1, 8, 2)), ValueError, "k must be 4-D"),
    (((1, 8, 3, 16), (1, 8, 2, 16), (1, 8, 2, 16)), ValueError, "multiple of k's nheads"),
    (((1, 8, 2, 264), (1, 8, 2, 264), (1, 8, 2, 264)), ValueError, "at most 256, got 264"),
    (((1, 8, 2, 16), (1, 8, 2, 16), (1, 9, 2, 16)), ValueError, "same shape"),
    (((1, 0, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16)), ValueError, "q has an empty dimension"),
])
def test_bad_shapes_are_refused_at_trace_time(on_cpu, args, error, match):
    with pytest.raises(error, match=match):
        jax.jit(flash_attn)(*(jnp.zeros(s, jnp.float32) for s in args))


def test_bad_options_are_refused(on_cpu):
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="k has dtype"):
        flash_attn(q, q.astype(jnp.float16), q)
    with pytest.raises(ValueError, match="finite and positive"):
        flash_attn(q, q, q, softmax_scale=0.0)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attn(q, q, q, causal=1)
