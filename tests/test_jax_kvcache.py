"""cupyflash.jax.flash_attn_with_kvcache on XLA's CPU backend: the core's NumPy results and cache
appends, eager and under jit with the caches donated (updated in place), dense and paged, an int
cache_seqlens, and the trace-time checks naming the argument.
(The test_jax_*.py files are split by concern; test_jax_grad.py lists them.)
"""

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cupyflash  # noqa: E402
import cupyflash.jax as cfj  # noqa: E402
from cupyflash._arrays import bfloat16_dtype  # noqa: E402
from jax_helpers import on_cpu  # noqa: E402, F401


def _inputs(dtype, paged=False, seed=9):
    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    batch, seqlen_q, nheads, nheads_k, headdim = 2, 4, 4, 1, 24
    inputs = dict(q=draw(batch, seqlen_q, nheads, headdim), k=draw(batch, seqlen_q, nheads_k, headdim),
                  v=draw(batch, seqlen_q, nheads_k, headdim), cache_seqlens=np.array([0, 25], np.int32))
    angles = rng.uniform(0, 6.28, (64, 6))
    inputs.update(rotary_cos=np.cos(angles).astype(dtype), rotary_sin=np.sin(angles).astype(dtype))
    if paged:
        inputs.update(k_cache=draw(5, 16, nheads_k, headdim), v_cache=draw(5, 16, nheads_k, headdim),
                      block_table=np.array([[3, 1], [0, 4]], np.int32))
    else:
        inputs.update(k_cache=draw(batch, 32, nheads_k, headdim), v_cache=draw(batch, 32, nheads_k, headdim))
    return inputs


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("dtype", [np.float32, bfloat16_dtype()])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit-donated"])
def test_results_and_appended_caches_are_the_cores(dtype, paged, jit):
    inputs = _inputs(dtype, paged)
    options = dict(causal=True, window_size=(9, 0), alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    arrays = {name: value.copy() for name, value in inputs.items()}
    want_out, want_lse = cupyflash.flash_attn_with_kvcache(**arrays, **options, return_softmax_lse=True)

    def step(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, block_table=None, alibi=None):
        return cfj.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                           block_table=block_table, causal=True, window_size=(9, 0),
                                           alibi_slopes=alibi, return_softmax_lse=True)
    if jit:
        step = jax.jit(step, donate_argnums=(1, 2))
    args = [jnp.asarray(inputs[name]) for name in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens",
                                                     "rotary_cos", "rotary_sin")]
    out, lse, k_cache, v_cache = step(*args, jnp.asarray(inputs["block_table"]) if paged else None,
                                      jnp.asarray(options["alibi_slopes"]))
    np.testing.assert_array_equal(np.asarray(out), want_out)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)
    np.testing.assert_array_equal(np.asarray(k_cache), arrays["k_cache"])
    np.testing.assert_array_equal(np.asarray(v_cache), arrays["v_cache"])
    assert not np.array_equal(np.asarray(k_cache), inputs["k_cache"])  # something was appended


@pytest.mark.usefixtures("on_cpu")
def test_an_int_length_and_no_new_tokens():
    inputs = _inputs(np.float32)
    q, k_cache, v_cache = (jnp.asarray(inputs[name]) for name in ("q", "k_cache", "v_cache"))
    out, k_after, _ = cfj.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20)
    want = cupyflash.flash_attn_with_kvcache(inputs["q"], inputs["k_cache"].copy(), inputs["v_cache"].copy(),
                                             cache_seqlens=20)
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(k_after), inputs["k_cache"])
    for length in (np.int32(20), np.int64(20)):  # a NumPy integer is an int, as in the core
        np.testing.assert_array_equal(np.asarray(cfj.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=length)[0]),
                                      want)


@pytest.mark.usefixtures("on_cpu")
def test_trace_time_checks_name_the_argument():
    inputs = {name: jnp.asarray(value) for name, value in _inputs(np.float32).items()}
    with pytest.raises(ValueError, match="k and v come together"):
        cfj.flash_attn_with_kvcache(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["k"])
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 array"):
        cfj.flash_attn_with_kvcache(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                                    cache_seqlens=inputs["cache_seqlens"].astype(jnp.float32))
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin come together"):
        cfj.flash_attn_with_kvcache(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["k"], inputs["v"],
                                    inputs["rotary_cos"], cache_seqlens=inputs["cache_seqlens"])
    with pytest.raises(ValueError, match="page size"):
        cfj.flash_attn_with_kvcache(inputs["q"], inputs["k_cache"].reshape(8, 8, 1, 24),
                                    inputs["v_cache"].reshape(8, 8, 1, 24), cache_seqlens=3,
                                    block_table=jnp.zeros((2, 4), jnp.int32))
