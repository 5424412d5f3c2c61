"""Helpers shared by the test_jax_*.py files: the on_cpu fixture, input makers, jax.nn's attention as a
reference, float32 comparisons, the option matrix (tests/option_cases.py) in cupyflash.jax's
spelling with its array options, and the GPU case runner."""

import os

import numpy
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cupyflash.options  # noqa: E402
from cupyflash import _check, reference  # noqa: E402
from cupyflash.jax import (flash_attn, flash_attn_varlen, forward_with_lse,  # noqa: E402
                           varlen_forward_with_lse)

import option_cases  # noqa: E402


# The option matrix (tests/option_cases.py) as cupyflash.jax spells it.
OPTIONS = option_cases.jax_options()
VARLEN_OPTIONS = option_cases.varlen_options(OPTIONS)
OPTION_SHAPES, LENGTHS = option_cases.OPTION_SHAPES, option_cases.LENGTHS


FLOAT32_EPS = float(numpy.finfo(numpy.float32).eps)


@pytest.fixture
def on_cpu():
    """Runs the test on XLA's CPU backend even where a GPU is the default device."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _bottom_right_mask(seqlen_q, seqlen_k):
    # cupyflash's causal mask: query i sees key j iff j <= i + seqlen_k - seqlen_q
    # (jax.nn.dot_product_attention's is_causal is aligned top-left instead).
    return jnp.tril(jnp.ones((seqlen_q, seqlen_k), bool), seqlen_k - seqlen_q)[None, None]


def _jax_attention(q, k, v, scale, causal):
    mask = _bottom_right_mask(q.shape[1], k.shape[1]) if causal else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")


def _random(shape, seed, dtype=numpy.float32):
    return jnp.asarray(numpy.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _assert_close(name, got, ref):
    """float32 against float32: jax.nn's naive attention rounds every score, softmax term and sum of at
    most 113 terms; 16 n eps (n = 113 summed terms, eps = float32's) bounds that error relative to
    the largest magnitude with a wide margin (seen: under 4 eps). A mask, GQA mapping, scale or
    gradient routed wrongly shows as errors of order 1."""
    got, ref = numpy.asarray(got, numpy.float64), numpy.asarray(ref, numpy.float64)
    assert got.shape == ref.shape, name
    bound = 16 * 113 * FLOAT32_EPS * (1 + numpy.abs(ref).max())
    error = numpy.abs(got - ref).max()
    assert error <= bound, f"{name}: max error {error:.3g} > {bound:.3g}"


def _make_options(spec, shape, seed):
    """flash_attn's keyword options: slopes float32 in [0.05, 0.55), float32 normal biases of the named
    shape, and a random uint32 (2,) dropout seed for 'array'."""
    batch, seqlen_q, seqlen_k, nheads = shape[:4]
    rng = numpy.random.default_rng(seed)
    options = dict(spec)
    for name, form in spec.items():
        if name in [o.name for o in cupyflash.options.OPTIONS] and cupyflash.options.by_name(name).kind == "array":
            options[name] = jnp.asarray(cupyflash.options.by_name(name).example(rng, (batch, nheads, seqlen_q, seqlen_k),
                                                                                 form))
    if options.get("dropout_seed") == "array":
        options["dropout_seed"] = jnp.asarray(rng.integers(0, 2 ** 32, 2, dtype=numpy.uint32))
    return options


def _seed_int(seed):
    if seed is None or isinstance(seed, int):
        return seed
    low, high = (int(x) for x in numpy.asarray(seed))
    return low | high << 32


def _reference_options(options):
    """The reference's keyword options for flash_attn's."""
    result = dict(window_size=tuple(options.get("window_size", (-1, -1))), softcap=options.get("softcap", 0.0),
                  dropout_p=options.get("dropout_p", 0.0), seed=_seed_int(options.get("dropout_seed")))
    for name in ("alibi_slopes", "attn_bias"):
        if options.get(name) is not None:
            result[name] = numpy.asarray(options[name], numpy.float64)
    return result


def _f64(x):
    return numpy.asarray(x, numpy.float64)


def _assert_rounded(name, got, ref):
    """got is the float64 ref rounded to float32 (twice at most: lse): within 2 float32 eps of the
    largest magnitude; -inf exactly where ref has it."""
    got, ref = _f64(got), _f64(ref)
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    assert numpy.array_equal(numpy.isneginf(got), numpy.isneginf(ref)), name
    finite = numpy.isfinite(ref)
    scale = 1 + (numpy.abs(ref[finite]).max() if finite.any() else 0)
    error = numpy.abs(got[finite] - ref[finite]).max(initial=0)
    assert error <= 2 * FLOAT32_EPS * scale, f"{name}: error {error:.3g}"


def _split(options):
    """(the array options, by name: differentiated or traced; the rest, static)."""
    arrays = {n: options[n] for n in ("alibi_slopes", "attn_bias", "dropout_seed")
              if n in options and not isinstance(options[n], int)}
    return arrays, {n: v for n, v in options.items() if n not in arrays}


def _vjp_with_options(function, q, k, v, dout, options, jit):
    """function(q, k, v, **options)'s value and the cotangents of q, k, v and of the array options
    (a dict), eagerly or as one jitted function of all the arrays."""
    arrays, static = _split(options)

    def call(q, k, v, arrays):
        return function(q, k, v, **arrays, **static)

    if jit:
        call = jax.jit(call)
    out, vjp = jax.vjp(call, q, k, v, arrays)
    return out, vjp(dout)


def _mask_and_bias(seqlen_q, seqlen_k, causal, window_size, alibi_slopes, attn_bias):
    """jax.nn.dot_product_attention's mask and bias (4-D) for cupyflash's window/causal masks, ALiBi and
    attn_bias."""
    mask = jnp.asarray(reference.visible(seqlen_q, seqlen_k, causal, window_size=window_size))[None, None]
    distance = jnp.abs(jnp.arange(seqlen_k)[None, :] - jnp.arange(seqlen_q)[:, None] - (seqlen_k - seqlen_q))
    alibi = -alibi_slopes.reshape(-1, alibi_slopes.shape[-1], 1, 1) * distance
    return mask, alibi + attn_bias.reshape((1,) * (4 - attn_bias.ndim) + attn_bias.shape)


def _gpu():
    return jax.devices("gpu")[0]


def _poison_xla_memory():
    """Fills memory XLA's allocator will hand out next with NaN, so unwritten results show."""
    junk = jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32), _gpu())
    junk.block_until_ready()
    del junk


def _gpu_case_call(case, inputs):
    """(attention(q, k, v, *bias), forward_with_lse-like(q, k, v), the arrays) for a _check Case on the
    GPU: the dropout seed is the int of `inputs` (a constant of the program), the rest are operands."""
    dtype = jnp.bfloat16 if case.dtype == "bfloat16" else jnp.float16
    arrays = {n: jnp.asarray(inputs[n]).astype(dtype) for n in ("q", "k", "v", "dout")}
    options = {}
    for name, setting in case.options:  # arrays float32, but 'heads' biases (values of case.dtype) in it
        if cupyflash.options.by_name(name).kind != "array":
            options[name] = setting
        else:
            array = jnp.asarray(inputs[name]).astype(dtype if setting == "heads" else jnp.float32)
            # attn_bias is differentiated: an argument of the attention function, the others options
            (arrays if cupyflash.options.by_name(name).gradient else options)[name] = array
    if "seed" in inputs:
        options["dropout_seed"] = inputs["seed"]
    scale = case.headdim ** -0.5
    if case.varlen:
        packing = (*(jnp.asarray(c) for c in case.cu_seqlens()), case.seqlen_q, case.seqlen_k)
        return (lambda q, k, v: flash_attn_varlen(q, k, v, *packing, scale, case.causal, **options),
                lambda q, k, v: varlen_forward_with_lse(q, k, v, *packing, scale, case.causal, **options), arrays)
    return (lambda q, k, v, *bias: flash_attn(q, k, v, scale, case.causal, attn_bias=(bias or [None])[0], **options),
            lambda q, k, v: forward_with_lse(q, k, v, scale, case.causal, attn_bias=arrays.get("attn_bias"),
                                             **options),
            arrays)


def _run_gpu_case(case, seed, jit):
    inputs = _check.random_inputs(case, seed)
    with jax.default_device(_gpu()):
        attention, forward, arrays = _gpu_case_call(case, inputs)
        if jit:
            attention, forward = jax.jit(attention), jax.jit(forward)
        primals = [arrays[n] for n in ("q", "k", "v", "attn_bias") if n in arrays]
        _poison_xla_memory()
        out, lse = forward(*primals[:3])
        out_vjp, vjp = jax.vjp(attention, *primals)
        grads = vjp(arrays["dout"])
    assert all(x.devices() == {_gpu()} for x in (out, lse, *grads))
    assert [g.dtype for g in grads] == [x.dtype for x in primals] and [g.shape for g in grads] == [x.shape for x in primals]

    def host(x):
        return numpy.asarray(x.astype(jnp.float32), numpy.float64)

    assert numpy.array_equal(host(out), host(out_vjp))  # same kernel, same inputs (and seed)
    return _check.compare(case, inputs, host(out), host(lse), [host(g) for g in grads]), grads
