"""cupyflash.jax, varlen on XLA's CPU backend: each option of the matrix (tests/option_cases.py) against
the float64 reference eager and under jit, cu_seqlens as operands of one program, and the checks
of a bad packing.
(The test_jax_*.py files are split by concern; test_jax_grad.py lists them.)
"""

import os

import numpy
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
pytest.register_assert_rewrite("jax_helpers")

from cupyflash import reference  # noqa: E402
from cupyflash.jax import flash_attn_varlen, varlen_forward_with_lse  # noqa: E402
from jax_helpers import (LENGTHS, VARLEN_OPTIONS, _assert_close, _assert_rounded, _f64,  # noqa: E402, F401
                         _jax_attention, _make_options, _random, _reference_options, _vjp_with_options, on_cpu)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", VARLEN_OPTIONS)
def test_cpu_varlen_matches_reference(on_cpu, name, causal, jit):
    q, k, v, dout = (_random((sum(LENGTHS[i]), heads, 16), 32 + n)
                     for n, (i, heads) in enumerate([(0, 4), (1, 2), (1, 2), (0, 4)]))
    cu_q, cu_k = (numpy.cumsum((0,) + lengths).astype(numpy.int32) for lengths in LENGTHS)
    options = _make_options(VARLEN_OPTIONS[name], (len(LENGTHS[0]), 0, 0, 4), 36)
    packing = (jnp.asarray(cu_q), jnp.asarray(cu_k), max(LENGTHS[0]), max(LENGTHS[1]))
    attention = lambda q, k, v, **o: flash_attn_varlen(q, k, v, *packing, 0.3, causal, **o)  # noqa: E731
    out, (dq, dk, dv, d_arrays) = _vjp_with_options(attention, q, k, v, dout, options, jit)
    _, lse = varlen_forward_with_lse(q, k, v, *packing, 0.3, causal, **options)

    ref_options = _reference_options(options)
    args = [_f64(x) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention_forward_varlen(*args, cu_q, cu_k, 0.3, causal, **ref_options)
    ref_grads = reference.attention_backward_varlen(_f64(dout), *args, cu_q, cu_k, 0.3, causal, **ref_options)
    assert lse.shape == (4, sum(LENGTHS[0]))
    for what, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), (ref_out, ref_lse, *ref_grads)):
        _assert_rounded(what, got, ref)
    if "alibi_slopes" in options:
        assert not numpy.asarray(d_arrays["alibi_slopes"]).any()


def test_cpu_varlen_cu_seqlens_are_operands(on_cpu):
    """Packings of one shape share one jitted program, and each gives its own sequences' attention."""
    q, k, v = _random((12, 2, 8), 37), _random((12, 2, 8), 38), _random((12, 2, 8), 39)
    traces = []

    @jax.jit
    def attention(q, k, v, cu):
        traces.append(cu)
        return flash_attn_varlen(q, k, v, cu, cu, 12, 12, causal=True)

    for lengths in [(3, 9), (12, 0), (5, 7)]:
        cu = numpy.cumsum((0,) + lengths).astype(numpy.int32)
        got = attention(q, k, v, jnp.asarray(cu))
        for b in range(2):
            rows = slice(cu[b], cu[b + 1])
            if rows.start < rows.stop:
                _assert_close(f"{lengths} sequence {b}", got[rows],
                              _jax_attention(q[None, rows], k[None, rows], v[None, rows], 8 ** -0.5, True)[0])
    assert len(traces) == 1


def test_cpu_varlen_bad_packing_is_refused(on_cpu):
    q = jnp.zeros((9, 2, 16), jnp.float32)
    good = jnp.asarray([0, 4, 9], jnp.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 array"):
        flash_attn_varlen(q, q, q, good.astype(jnp.float32), good, 5, 5)
    with pytest.raises(ValueError, match="same length"):
        flash_attn_varlen(q, q, q, good, jnp.asarray([0, 9], jnp.int32), 5, 9)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int >= 0"):
        flash_attn_varlen(q, q, q, good, good, 5, 5.0)
    with pytest.raises(ValueError, match="q must be 3-D"):
        flash_attn_varlen(q[None], q, q, good, good, 5, 5)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flash_attn_varlen(q, q, q, good, good, 5, 5, alibi_slopes=jnp.ones((3, 2), jnp.float32))
    # Values are checked when the call runs (they are operands), by the core, through XLA's error.
    with pytest.raises(Exception, match="max_seqlen_q must be >= the longest sequence"):
        jax.block_until_ready(flash_attn_varlen(q, q, q, good, good, 4, 5))
    with pytest.raises(Exception, match="cu_seqlens_k must end at the packed length 9"):
        jax.block_until_ready(jax.jit(flash_attn_varlen, static_argnums=(5, 6))(
            q, q, q, good, jnp.asarray([0, 4, 8], jnp.int32), 5, 5))
