"""cupyflash.jax on the GPU (marked `gpu`): the kernels on XLA's stream, eager and under jit, under
cupyflash/_check.py's rule against the float64 reference: plain, the options and varlen, ordering
with XLA's own work, the deterministic backward, the dropout seed and cu_seqlens computed in the
program, and grad against jax.nn with a bias and a mask; then the handlers writing XLA's buffers:
bit for bit the eager core's, for new seeds and packings under one jit, dbias only when asked for,
back-to-back steps, and no copy.
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

from cupyflash import _check, reference  # noqa: E402
from cupyflash._check import Case  # noqa: E402
import option_cases  # noqa: E402
from cupyflash.jax import flash_attn, forward_with_lse, varlen_forward_with_lse  # noqa: E402
from jax_helpers import _gpu, _mask_and_bias, _poison_xla_memory, _run_gpu_case, _seed_int  # noqa: E402

# --------------------------------------------------------------------------------------------
# GPU: the kernels on XLA's stream, eager and under jit.


GPU_CASES = [Case(113, 113, 40, "bfloat16", True), Case(113, 113, 40, "float16", False),
             Case(17, 113, 64, "float16", True, nheads=6, nheads_k=2),
             Case(113, 17, 128, "bfloat16", True, nheads=4, nheads_k=1),   # rows that see no key
             Case(257, 300, 96, "bfloat16", False, batch=3, nheads=4, nheads_k=4),
             Case(1, 1000, 256, "float16", True, batch=1)]


@pytest.mark.gpu
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_matches_reference(case, jit):
    """out, lse and the vjp's (dq, dk, dv) under _check.py's rule (2x / 3x the naive low-precision error)."""
    inputs = _check.random_inputs(case, 17)
    dtype = jnp.bfloat16 if case.dtype == "bfloat16" else jnp.float16
    with jax.default_device(_gpu()):
        q, k, v, dout = (jnp.asarray(inputs[n]).astype(dtype) for n in ("q", "k", "v", "dout"))
        forward = functools.partial(forward_with_lse, causal=case.causal)
        attention = functools.partial(flash_attn, causal=case.causal)
        if jit:
            forward, attention = jax.jit(forward), jax.jit(attention)
        _poison_xla_memory()
        out, lse = forward(q, k, v)
        out_vjp, vjp = jax.vjp(attention, q, k, v)
        grads = vjp(dout)
    assert all(x.devices() == {_gpu()} for x in (out, lse, *grads))

    def host(x):
        return numpy.asarray(x.astype(jnp.float32), numpy.float64)

    assert numpy.array_equal(host(out), host(out_vjp))  # same kernel, same inputs
    result = _check.compare(case, inputs, host(out), host(lse), [host(g) for g in grads])
    assert result.ok, f"{case}: {result.describe()}"


@pytest.mark.gpu
def test_gpu_jit_orders_with_xla_work_on_its_stream():
    """q comes out of a long XLA computation and out goes into another: a launch on any stream other
    than XLA's would read q before it is written or let XLA read out before it is."""
    case = Case(256, 256, 64, "bfloat16", True, batch=2, nheads=4, nheads_k=4)
    inputs = _check.random_inputs(case, 23)

    @jax.jit
    def program(q, k, v, m):
        for _ in range(30):  # ~30 dependent 4096^3 matmuls before q is ready
            m = jnp.tanh(m @ m)
        q = q + (m[0, 0] * 0).astype(q.dtype)  # depends on all of it (x * 0 is not folded for floats)
        out, lse = forward_with_lse(q, k, v, causal=True)
        return out * 2, lse + 1  # XLA work that reads the results

    with jax.default_device(_gpu()):
        q, k, v = (jnp.asarray(inputs[n]).astype(jnp.bfloat16) for n in ("q", "k", "v"))
        m = jax.random.normal(jax.random.PRNGKey(0), (4096, 4096), jnp.float32) * 4096 ** -0.5
        _poison_xla_memory()
        out2, lse1 = program(q, k, v, m)
    out = numpy.asarray(out2.astype(jnp.float32), numpy.float64) / 2  # exact: powers of two
    result = _check.compare(case, inputs, out, numpy.asarray(lse1, numpy.float64) - 1, None)
    assert result.ok, result.describe()


@pytest.mark.gpu
def test_gpu_refuses_float32_with_the_core_message():
    """An error raised by the core inside the CUDA handler comes back through XLA with its message."""
    with jax.default_device(_gpu()):
        q = jnp.zeros((1, 8, 2, 16), jnp.float32)
        with pytest.raises(Exception, match="q must have dtype float16 or bfloat16"):
            jax.block_until_ready(jax.jit(flash_attn)(q, q, q))


# The torch tests run one more case (a deterministic backward alone).
GPU_OPTION_CASES = [case for case in option_cases.GPU_CASES if case.options != (("deterministic", True),)]


@pytest.mark.gpu
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", GPU_OPTION_CASES, ids=str)
def test_gpu_options_match_reference(case, jit):
    result, _ = _run_gpu_case(case, 44, jit)
    assert result.ok, f"{case}: {result.describe()}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", option_cases.DETERMINISTIC_CASES, ids=str)
def test_gpu_deterministic_backward_is_bitwise_repeatable(case):
    runs = [_run_gpu_case(case, 45, jit=True)[1] for _ in range(3)]
    for first, *others in zip(*runs):
        assert all(numpy.array_equal(first, other) for other in others)


@pytest.mark.gpu
def test_gpu_dropout_seed_is_a_traced_operand():
    """A seed computed inside the program (XLA writes it just before the call) reaches the kernels: the
    same seed gives the same result, bit for bit, another seed another, with one trace."""
    case = Case(113, 200, 64, "bfloat16", True, nheads=4, nheads_k=2, dropout_p=0.2)
    inputs = _check.random_inputs(case, 46)
    traces = []

    @jax.jit
    def attention(q, k, v, key):
        traces.append(key)
        seed = jax.random.bits(key, (2,), jnp.uint32)
        return forward_with_lse(q, k, v, case.headdim ** -0.5, True, dropout_p=0.2, dropout_seed=seed), seed

    with jax.default_device(_gpu()):
        q, k, v = (jnp.asarray(inputs[n]).astype(jnp.bfloat16) for n in ("q", "k", "v"))
        ((first, lse), seed), ((again, _), _), ((other, _), _) = (attention(q, k, v, jax.random.PRNGKey(s))
                                                                 for s in (1, 1, 2))
    assert len(traces) == 1
    assert numpy.array_equal(first, again) and not numpy.array_equal(first, other)
    inputs["seed"] = _seed_int(seed)  # the seed the program computed
    result = _check.compare(case, inputs, numpy.asarray(first.astype(jnp.float32), numpy.float64),
                            numpy.asarray(lse, numpy.float64), None)
    assert result.ok, result.describe()


@pytest.mark.gpu
def test_gpu_varlen_cu_seqlens_computed_by_xla():
    """cu_seqlens that XLA computes on the GPU in the same program, right before the call: the kernels
    read them on XLA's stream, after they are written (no host read)."""
    case = Case.packed((300, 17, 200), (250, 500, 17), 64, "bfloat16", True, nheads=4, nheads_k=2)
    inputs = _check.random_inputs(case, 47)

    @jax.jit
    def attention(q, k, v, lengths_q, lengths_k, m):
        for _ in range(30):  # ~30 dependent 4096^3 matmuls before the lengths are ready
            m = jnp.tanh(m @ m)
        delay = (m[0, 0] * 0).astype(jnp.int32)
        cu_q, cu_k = (jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(x + delay).astype(jnp.int32)])
                      for x in (lengths_q, lengths_k))
        return varlen_forward_with_lse(q, k, v, cu_q, cu_k, case.seqlen_q, case.seqlen_k, case.headdim ** -0.5, True)

    with jax.default_device(_gpu()):
        q, k, v = (jnp.asarray(inputs[n]).astype(jnp.bfloat16) for n in ("q", "k", "v"))
        lengths = [jnp.asarray(x, jnp.int32) for x in case.varlen]
        m = jax.random.normal(jax.random.PRNGKey(0), (4096, 4096), jnp.float32) * 4096 ** -0.5
        out, lse = attention(q, k, v, *lengths, m)
    result = _check.compare(case, inputs, numpy.asarray(out.astype(jnp.float32), numpy.float64),
                            numpy.asarray(lse, numpy.float64), None)
    assert result.ok, result.describe()


@pytest.mark.gpu
def test_gpu_grad_matches_dot_product_attention_with_bias_and_mask():
    """jax.grad (q, k, v and attn_bias) against jax.nn.dot_product_attention with the window as its mask
    and ALiBi plus the bias as its bias, in _check.py's rule: cupyflash in bfloat16 may be 2x (value)
    or 3x (gradients) farther from jax.nn in float32 than jax.nn in bfloat16 is, plus one bfloat16
    ulp at the result's scale and 1/64 of one at unit scale."""
    batch, sq, sk, h, hk, d, window = 2, 200, 300, 4, 2, 64, (64, 16)
    rng = numpy.random.default_rng(48)
    with jax.default_device(_gpu()):
        q, k, v = (jnp.asarray(reference.round_to(rng.standard_normal(s), "bfloat16"), jnp.float32)
                   for s in ((batch, sq, h, d), (batch, sk, hk, d), (batch, sk, hk, d)))
        bias = jnp.asarray(reference.round_to(rng.standard_normal((h, sq, sk)), "bfloat16"), jnp.float32)
        slopes = jnp.asarray(rng.uniform(0.01, 0.1, (batch, h)).astype(numpy.float32))

        def loss_ours(q, k, v, bias):
            out = flash_attn(q, k, v, 0.125, True, window_size=window, alibi_slopes=slopes, attn_bias=bias)
            return jnp.sum(jnp.sin(out.astype(jnp.float32)))

        def loss_theirs(q, k, v, bias):
            mask, full_bias = _mask_and_bias(sq, sk, True, window, slopes, bias)
            out = jax.nn.dot_product_attention(q, k, v, bias=full_bias.astype(q.dtype), mask=mask, scale=0.125,
                                               implementation="xla")
            return jnp.sum(jnp.sin(out.astype(jnp.float32)))

        grad = functools.partial(jax.grad, argnums=(0, 1, 2, 3))
        bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v, bias)]
        ours = jax.jit(grad(loss_ours))(*bf16)
        naive = jax.jit(grad(loss_theirs))(*bf16)
        with jax.default_matmul_precision("highest"):
            truth = jax.jit(grad(loss_theirs))(q, k, v, bias)
    for name, x, n, t in zip(("dq", "dk", "dv", "dbias"), ours, naive, truth):
        x, n, t = (numpy.asarray(a.astype(jnp.float32), numpy.float64) for a in (x, n, t))
        floor = 2.0 ** -7 * (numpy.abs(t).max() + 2.0 ** -6)
        error, naive_error = numpy.abs(x - t).max(), numpy.abs(n - t).max()
        assert error <= 3 * naive_error + floor, f"{name}: error {error:.3g}, naive {naive_error:.3g}"


# --------------------------------------------------------------------------------------------
# The handlers in place: jitted results bit for bit the eager core's (the same kernels on the same
# inputs; deterministic backwards), for new seeds and packings without a retrace, with nothing copied.

def _same_bits(name, got, want):
    got, want = numpy.asarray(got), numpy.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert got.tobytes() == want.tobytes(), f"{name}: not bit for bit the eager core's"


def _arrays_of(case, inputs):
    """(q, k, v, dout, the differentiated bias or None, the other options in cupyflash.jax's
    spelling, the same in the core's) as GPU arrays; the backward deterministic, the seed an array
    for JAX and its int for the core."""
    dtype = jnp.bfloat16 if case.dtype == "bfloat16" else jnp.float16
    q, k, v, dout = (jnp.asarray(inputs[n]).astype(dtype) for n in ("q", "k", "v", "dout"))
    bias, jax_options = None, {"deterministic": True}
    for name, setting in case.options:
        if name == "attn_bias":
            bias = jnp.asarray(inputs[name]).astype(dtype if setting == "heads" else jnp.float32)
        elif name != "deterministic":
            jax_options[name] = jnp.asarray(inputs[name]) if name == "alibi_slopes" else setting
    core_options = dict(jax_options)  # the backward's; the forward's are these but deterministic
    if "seed" in inputs:
        seed = inputs["seed"]
        jax_options["dropout_seed"] = jnp.asarray([seed & 0xFFFFFFFF, seed >> 32], jnp.uint32)
        core_options["seed"] = seed
    return q, k, v, dout, bias, jax_options, core_options


def _jitted_and_core(case, inputs):
    """((out, lse, grads) of cupyflash.jax under jit, the same from the eager core)."""
    import cupyflash
    from cupyflash.jax import flash_attn_varlen
    with jax.default_device(_gpu()):
        q, k, v, dout, bias, jax_options, core_options = _arrays_of(case, inputs)
        forward_options = {n: x for n, x in core_options.items() if n != "deterministic"}
        scale = case.headdim ** -0.5
        if case.varlen:
            packing = (*(jnp.asarray(c) for c in case.cu_seqlens()), case.seqlen_q, case.seqlen_k)
            attention = lambda q, k, v: flash_attn_varlen(q, k, v, *packing, scale, case.causal,  # noqa: E731
                                                          **jax_options)
            forward = jax.jit(lambda q, k, v: varlen_forward_with_lse(q, k, v, *packing, scale, case.causal,
                                                                      **jax_options))
            out, lse = cupyflash.flash_attn_varlen_func(q, k, v, *packing, scale, case.causal, return_lse=True,
                                                        **forward_options)
            core_grads = cupyflash.flash_attn_varlen_backward(dout, q, k, v, out, lse, *packing, scale, case.causal,
                                                              **core_options)
        else:
            attention = lambda q, k, v, *bias: flash_attn(q, k, v, scale, case.causal,  # noqa: E731
                                                          attn_bias=(bias or [None])[0], **jax_options)
            forward = jax.jit(lambda q, k, v: forward_with_lse(q, k, v, scale, case.causal, attn_bias=bias,
                                                               **jax_options))
            out, lse = cupyflash.flash_attn_func(q, k, v, scale, case.causal, return_lse=True, attn_bias=bias,
                                                 **forward_options)
            core_grads = cupyflash.flash_attn_backward(dout, q, k, v, out, lse, scale, case.causal, attn_bias=bias,
                                                       return_dbias=bias is not None, **core_options)
        primals = (q, k, v) + ((bias,) if bias is not None else ())
        _poison_xla_memory()
        jitted = (*forward(q, k, v), jax.jit(lambda *p: jax.vjp(attention, *p)[1](dout))(*primals))
    return jitted, (out, lse, tuple(g for g in core_grads if g is not None))


BITWISE_CASES = [Case(113, 113, 64, "bfloat16", True), Case(17, 113, 128, "float16", True, nheads=6, nheads_k=2),
                 Case(113, 150, 20, "bfloat16", True),  # a head dim the core pads: the copying path
                 Case(113, 150, 64, "float16", True, nheads=4, nheads_k=2, attn_bias="heads"),
                 option_cases.GPU_CASES[8],  # every option at once
                 Case.packed((0, 1, 17, 113, 5), (3, 0, 17, 200, 5), 64, "float16", False, nheads=4, nheads_k=2,
                             window_size=(20, 5), alibi_slopes=True, dropout_p=0.2)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", BITWISE_CASES, ids=str)
def test_gpu_jit_is_the_eager_core_bit_for_bit(case):
    """out, lse, dq, dk, dv (and dbias) of jitted calls, written by the kernels into XLA's buffers,
    equal the eager core's on the same inputs bit for bit."""
    (out, lse, grads), (core_out, core_lse, core_grads) = _jitted_and_core(case, _check.random_inputs(case, 60))
    _same_bits("out", out, core_out)
    _same_bits("lse", lse, core_lse)
    assert len(grads) == len(core_grads)
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, core_grads):
        _same_bits(name, got, want)


@pytest.mark.gpu
def test_gpu_dropout_seed_operand_under_one_jit():
    """A new dropout_seed under the same jitted fwd+bwd gives a new mask without a retrace; each
    seed's results are the eager core's with that seed's int, bit for bit."""
    import cupyflash
    case = Case(113, 200, 64, "bfloat16", True, nheads=4, nheads_k=2, dropout_p=0.2)
    inputs = _check.random_inputs(case, 61)
    traces = []

    @jax.jit
    def step(q, k, v, dout, seed):
        traces.append(seed)
        attention = functools.partial(flash_attn, causal=True, dropout_p=0.2, dropout_seed=seed, deterministic=True)
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(dout)

    with jax.default_device(_gpu()):
        q, k, v, dout = (jnp.asarray(inputs[n]).astype(jnp.bfloat16) for n in ("q", "k", "v", "dout"))
        seeds = [(5, 7), (5, 7), (6, 7), (5, 8)]
        runs = [step(q, k, v, dout, jnp.asarray(s, jnp.uint32)) for s in seeds]
        for (low, high), (out, grads) in zip(seeds, runs):
            core_out, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True, dropout_p=0.2,
                                                      seed=low | high << 32)
            core_grads = cupyflash.flash_attn_backward(dout, q, k, v, core_out, lse, causal=True, dropout_p=0.2,
                                                       seed=low | high << 32, deterministic=True)
            _same_bits("out", out, core_out)
            for name, got, want in zip(("dq", "dk", "dv"), grads, core_grads):
                _same_bits(name, got, want)
    assert len(traces) == 1
    _same_bits("same seed", runs[1][0], runs[0][0])
    assert not numpy.array_equal(numpy.asarray(runs[2][0]), numpy.asarray(runs[0][0]))
    assert not numpy.array_equal(numpy.asarray(runs[3][0]), numpy.asarray(runs[0][0]))


@pytest.mark.gpu
def test_gpu_varlen_new_cu_seqlens_under_one_jit():
    """Packings of one shape under one jitted fwd+bwd (one launch plan): each is the eager core's
    with its own cu_seqlens, bit for bit."""
    import cupyflash
    from cupyflash.jax import flash_attn_varlen
    total, traces = 330, []

    @jax.jit
    def step(q, k, v, dout, cu_q, cu_k):
        traces.append(cu_q)
        attention = functools.partial(flash_attn_varlen, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=total,
                                      max_seqlen_k=total, causal=True, deterministic=True)
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(dout)

    rng = numpy.random.default_rng(62)
    with jax.default_device(_gpu()):
        q, k, v, dout = (jnp.asarray(rng.standard_normal((total, 4, 64), numpy.float32)).astype(jnp.bfloat16)
                         for _ in range(4))
        for lengths_q, lengths_k in [((300, 30), (30, 300)), ((1, 329), (329, 1)), ((330, 0), (0, 330))]:
            cu_q, cu_k = (jnp.asarray(numpy.cumsum((0,) + lengths), jnp.int32) for lengths in (lengths_q, lengths_k))
            out, grads = step(q, k, v, dout, cu_q, cu_k)
            core_out, lse = cupyflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, total, total, causal=True,
                                                             return_lse=True)
            core_grads = cupyflash.flash_attn_varlen_backward(dout, q, k, v, core_out, lse, cu_q, cu_k, total, total,
                                                              causal=True, deterministic=True)
            _same_bits(f"{lengths_q} out", out, core_out)
            for name, got, want in zip(("dq", "dk", "dv"), grads, core_grads):
                _same_bits(f"{lengths_q} {name}", got, want)
    assert len(traces) == 1


@pytest.mark.gpu
def test_gpu_dbias_only_when_the_bias_is_differentiated():
    """With a constant bias the backward leaves dbias out and dq, dk, dv do not change."""
    case = Case(113, 150, 64, "bfloat16", True, nheads=4, nheads_k=2, attn_bias="full")
    inputs = _check.random_inputs(case, 63)
    with jax.default_device(_gpu()):
        q, k, v, dout, bias, jax_options, _ = _arrays_of(case, inputs)

        def attention(q, k, v, bias):
            return flash_attn(q, k, v, causal=True, attn_bias=bias, **jax_options)

        with_dbias = jax.jit(lambda *p: jax.vjp(attention, *p)[1](dout))(q, k, v, bias)
        without = jax.jit(lambda q, k, v: jax.vjp(lambda *p: attention(*p, bias), q, k, v)[1](dout))(q, k, v)
    assert len(without) == 3 and with_dbias[3].shape == bias.shape
    for name, got, want in zip(("dq", "dk", "dv"), without, with_dbias):
        _same_bits(name, got, want)


def _fwd_bwd(q, k, v, dout):
    out, vjp = jax.vjp(functools.partial(flash_attn, causal=True), q, k, v)
    return out, vjp(dout)


@pytest.mark.gpu
def test_gpu_jit_copies_nothing(monkeypatch):
    """A jitted fwd+bwd has no copy in XLA's compiled program and the handlers issue none (their one
    copy, cupyflash.jax._copy, runs only for the head dims the core pads)."""
    from cupyflash import jax as cfjax
    copies = []
    monkeypatch.setattr(cfjax, "_copy", lambda *args: copies.append(args))
    with jax.default_device(_gpu()):
        arrays = [jax.random.normal(key, (2, 128, 4, 64), jnp.float32).astype(jnp.bfloat16)
                  for key in jax.random.split(jax.random.PRNGKey(64), 4)]
        step = jax.jit(_fwd_bwd)
        jax.block_until_ready([step(*arrays) for _ in range(3)])
        hlo = step.lower(*arrays).compile().as_text()
        assert not copies and not re.findall(r"= \S+ copy(-start|-done)?\(", hlo)
        jax.block_until_ready(step(*(x[..., :20] for x in arrays)))  # padded: copies
    assert copies


@pytest.mark.gpu
def test_gpu_back_to_back_jitted_steps():
    """Twenty jitted fwd+bwd steps on new inputs with no wait between them (the backward's scratch
    among XLA's buffers), each the eager core's bit for bit afterwards."""
    import cupyflash

    @jax.jit
    def step(q, k, v, dout):
        out, vjp = jax.vjp(functools.partial(flash_attn, causal=True, deterministic=True), q, k, v)
        return out, vjp(dout)

    with jax.default_device(_gpu()):
        keys = jax.random.split(jax.random.PRNGKey(65), 20)
        inputs = [[jax.random.normal(k, (2, 256, 4, 64), jnp.float32).astype(jnp.bfloat16)
                   for k in jax.random.split(key, 4)] for key in keys]
        jax.block_until_ready(inputs)
        results = [step(*arrays) for arrays in inputs]
        for (q, k, v, dout), (out, grads) in zip(inputs, results):
            core_out, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
            _same_bits("out", out, core_out)
            core_grads = cupyflash.flash_attn_backward(dout, q, k, v, core_out, lse, causal=True, deterministic=True)
            for name, got, want in zip(("dq", "dk", "dv"), grads, core_grads):
                _same_bits(name, got, want)


@pytest.mark.gpu
def test_gpu_repeated_calls_find_their_launch(monkeypatch):
    """Each custom call's launch is built once, while the program is traced (its graph twin's: no
    kernel is compiled or loaded where XLA may be capturing a CUDA graph); every call (new inputs,
    same shapes) finds it by the signature attribute, which the handler reads as the first attribute."""
    from cupyflash import jax as cfjax
    built = []
    new_launch = cfjax._new_launch
    monkeypatch.setattr(cfjax, "_launches", {})
    monkeypatch.setattr(cfjax, "_new_launch",
                        lambda request, *args: built.append(request.target) or new_launch(request, *args))
    step = jax.jit(lambda *arrays: _fwd_bwd(*arrays))  # a new function: jit's trace cache holds none of it
    with jax.default_device(_gpu()):
        for key in jax.random.split(jax.random.PRNGKey(66), 3):
            arrays = [jax.random.normal(k, (1, 128, 2, 64), jnp.float32).astype(jnp.bfloat16)
                      for k in jax.random.split(key, 4)]
            jax.block_until_ready(step(*arrays))
    assert sorted(built) == [cfjax._BACKWARD + cfjax._GRAPH, cfjax._FORWARD + cfjax._GRAPH]
    assert all(signature is not None for signature, _, _ in cfjax._launches)
