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

from cupyflash import api, reference  # noqa: E402
from cupyflash.jax import flash_attn_varlen, varlen_forward_with_lse  # noqa: E402
from reference_helpers import paged_varlen_case, paged_varlen_refusals  # noqa: E402
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


@pytest.mark.parametrize("total", ["no_queries", "no_keys"])
def test_cpu_varlen_without_query_or_key_rows_has_gradients(on_cpu, total):
    """A packing whose every sequence lacks queries (or keys): empty results (out, dq, or dk and dv)
    come back empty, the others as the reference has them (zeros where no key is seen)."""
    lengths_q, lengths_k = ((0, 0), (3, 1)) if total == "no_queries" else ((4, 2), (0, 0))
    q, dout = (_random((sum(lengths_q), 2, 8), n) for n in (40, 41))
    k, v = (_random((sum(lengths_k), 1, 8), n) for n in (42, 43))
    cu_q, cu_k = (numpy.cumsum((0,) + lengths).astype(numpy.int32) for lengths in (lengths_q, lengths_k))
    attention = lambda q, k, v: flash_attn_varlen(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k),  # noqa: E731
                                                  max(max(lengths_q), 1), max(max(lengths_k), 1), 0.3, True)
    out, vjp = jax.vjp(attention, q, k, v)
    grads = vjp(dout)
    args = [_f64(x) for x in (q, k, v)]
    ref_out, _ = reference.attention_forward_varlen(*args, cu_q, cu_k, 0.3, True)
    ref_grads = reference.attention_backward_varlen(_f64(dout), *args, cu_q, cu_k, 0.3, True)
    for what, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert got.shape == ref.shape, what
        _assert_rounded(what, got, ref)


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
    # A packing of no query rows that claims some: XLA runs no call for an empty result, so an eager
    # call's values are checked before it (traced ones cannot be).
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the packed length 0"):
        flash_attn_varlen(q[:0], q, q, good, good, 5, 5)
    with pytest.raises(ValueError, match="max_seqlen_k must be >= the longest sequence"):
        flash_attn_varlen(q[:0], q, q, jnp.zeros(3, jnp.int32), good, 0, 4)


# --------------------------------------------------------------------------------------------
# block_table: prefill from a paged cache, gathered on the device.

def _paged_case(page=16):
    """paged_varlen_case in float32 JAX arrays: q, packed k and v (the reference's), cu_seqlens_q and _k,
    the block table and the caches; queries 3, 0 and 5 over 20, 7 and 33 keys."""
    q, k, v, cu_q, cu_k, table, caches = paged_varlen_case(numpy.random.default_rng(7), page)
    as_jax = lambda x: jnp.asarray(numpy.asarray(x, numpy.float32))  # noqa: E731
    return (as_jax(q), k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), cu_q, cu_k, jnp.asarray(table), table,
            [as_jax(c) for c in caches])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("page", [16, 32])
def test_cpu_varlen_over_a_paged_cache_matches_the_packed_reference_with_gradients_into_the_caches(on_cpu, page, jit):
    q, k, v, cu_q, cu_k, cu_q_host, cu_k_host, table, table_host, (k_cache, v_cache) = _paged_case(page)
    slopes = jnp.asarray(numpy.random.default_rng(8).uniform(0.05, 0.5, (3, 4)).astype(numpy.float32))
    dout = _random(q.shape, 9)

    def attention(q, k_cache, v_cache, cu_q, cu_k, table):
        return flash_attn_varlen(q, k_cache, v_cache, cu_q, cu_k, 5, 33, 0.3, True, softcap=2.0, alibi_slopes=slopes,
                                 block_table=table)
    run = jax.jit(attention) if jit else attention
    out, vjp = jax.vjp(lambda q, kc, vc: run(q, kc, vc, cu_q, cu_k, table), q, k_cache, v_cache)
    dq, dk_cache, dv_cache = vjp(dout)

    # the packed keys the reference reads are the caches' rows (float32), and their gradients land there
    blocks, rows = api.paged_rows(*(numpy.asarray(x) for x in (q, k_cache, v_cache)), cu_q_host, cu_k_host, table_host)[1:]
    args = [_f64(q), _f64(k_cache)[blocks, rows], _f64(v_cache)[blocks, rows]]
    options = dict(softcap=2.0, alibi_slopes=_f64(slopes))
    ref_out, ref_lse = reference.attention_forward_varlen(*args, cu_q_host, cu_k_host, 0.3, True, **options)
    ref_dq, ref_dk, ref_dv = reference.attention_backward_varlen(_f64(dout), *args, cu_q_host, cu_k_host, 0.3, True,
                                                                 **options)
    want_dk, want_dv = numpy.zeros(k_cache.shape), numpy.zeros(v_cache.shape)
    numpy.add.at(want_dk, (blocks, rows), ref_dk)
    numpy.add.at(want_dv, (blocks, rows), ref_dv)
    for what, got, ref in (("out", out, ref_out), ("dq", dq, ref_dq), ("dk_cache", dk_cache, want_dk),
                           ("dv_cache", dv_cache, want_dv)):
        _assert_rounded(what, got, ref)
    _, lse = varlen_forward_with_lse(q, k_cache, v_cache, cu_q, cu_k, 5, 33, 0.3, True, softcap=2.0,
                                     alibi_slopes=slopes, block_table=table)
    _assert_rounded("lse", lse, ref_lse)


def test_cpu_varlen_over_a_paged_cache_traces_once_for_new_lengths_and_tables(on_cpu):
    """Lengths and block tables are operands: new values reuse the program, each giving its own result."""
    q, _, _, cu_q, cu_k, _, _, table, _, (k_cache, v_cache) = _paged_case()
    traces = []

    @jax.jit
    def attention(cu_k, table):
        traces.append(table)
        return flash_attn_varlen(q, k_cache, v_cache, cu_q, cu_k, 5, 33, causal=True, block_table=table)

    for lengths, order in (((20, 7, 33), [0, 1, 2]), ((33, 0, 1), [2, 0, 1])):
        cu = jnp.asarray(numpy.cumsum((0,) + lengths).astype(numpy.int32))
        shuffled = table[numpy.array(order)]
        want = flash_attn_varlen(q, k_cache, v_cache, cu_q, cu, 5, 33, causal=True, block_table=shuffled)
        numpy.testing.assert_array_equal(attention(cu, shuffled), want)
    assert len(traces) == 1


def test_cpu_bad_paged_varlen_input_names_the_argument(on_cpu):
    q, _, _, cu_q, cu_k, _, _, table, table_host, (k_cache, v_cache) = _paged_case()
    arguments = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=33,
                     block_table=table)
    for changes, error, message in paged_varlen_refusals(table_host, numpy.asarray(k_cache), numpy.asarray(v_cache)):
        with pytest.raises(error, match=message):
            flash_attn_varlen(**dict(arguments, **{name: jnp.asarray(x) for name, x in changes.items()}))
    # No query rows where cu_seqlens_q claims some: checked before the call, which XLA skips (as unpaged)
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the packed length 0"):
        flash_attn_varlen(**dict(arguments, q=q[:0]))
