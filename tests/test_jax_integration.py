"""cupyflash.jax: the custom_vjp function through XLA's typed FFI, eager and under jit.

CPU tests run the FFI targets on XLA's CPU backend, where they call the NumPy reference: they
test the ctypes call-frame plumbing, jit, grad and the custom_vjp wiring for real, against
jax.nn.dot_product_attention in float32. GPU tests (marked `gpu`) run the CUDA kernels on XLA's
stream and hold them to cupyflash/_check.py's rule against the float64 reference.
"""

import functools
import json
import os
import re

import numpy
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from cupyflash import _check, _xla_ffi, reference  # noqa: E402
from cupyflash._check import Case  # noqa: E402
from cupyflash.jax import flash_attn, forward_with_lse  # noqa: E402

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


# --------------------------------------------------------------------------------------------
# The ctypes structures against the header of the installed jaxlib.

def _header():
    path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    with open(path) as f:
        return re.sub(r"//[^\n]*", "", f.read())


def _header_fields(text, struct):
    body = re.search(r"struct %s \{(.*?)\}" % struct, text, re.S)  # no struct here nests braces
    assert body, f"struct {struct} not found in c_api.h"
    if struct == "XLA_FFI_Api":
        functions = re.findall(r"_XLA_FFI_API_STRUCT_FIELD\(XLA_FFI_(\w+)\)", body.group(1))
        return ["struct_size", "extension_start", "api_version", "internal_api"] + functions
    return [re.search(r"(\w+)(\[\d*\])?$", decl.strip()).group(1)
            for decl in body.group(1).split(";") if decl.strip()]


def _header_constant(text, name):
    return int(re.search(r"\b%s\s*=\s*(\d+)" % name, text).group(1))


def test_ctypes_structures_follow_the_installed_header():
    text = _header()
    assert int(re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text).group(1)) == 0  # ABI-compatible family
    minor = int(re.search(r"#define XLA_FFI_API_MINOR (\d+)", text).group(1))
    assert minor >= _xla_ffi.API_VERSION[1], "jaxlib older than the FFI header these structures follow"
    for ours, struct in [(_xla_ffi.CallFrame, "XLA_FFI_CallFrame"), (_xla_ffi.Buffer, "XLA_FFI_Buffer"),
                         (_xla_ffi.Args, "XLA_FFI_Args"), (_xla_ffi.Rets, "XLA_FFI_Rets"),
                         (_xla_ffi.Attrs, "XLA_FFI_Attrs"), (_xla_ffi.Metadata, "XLA_FFI_Metadata"),
                         (_xla_ffi.MetadataExtension, "XLA_FFI_Metadata_Extension"),
                         (_xla_ffi.ApiVersion, "XLA_FFI_Api_Version"),
                         (_xla_ffi.ErrorCreateArgs, "XLA_FFI_Error_Create_Args"),
                         (_xla_ffi.StreamGetArgs, "XLA_FFI_Stream_Get_Args"),
                         (_xla_ffi.DeviceOrdinalGetArgs, "XLA_FFI_DeviceOrdinal_Get_Args")]:
        assert [name for name, _ in ours._fields_] == _header_fields(text, struct), struct
    for ours, struct in [(_xla_ffi.ByteSpan, "XLA_FFI_ByteSpan"), (_xla_ffi.Scalar, "XLA_FFI_Scalar")]:
        assert [name for name, _ in ours._fields_] == _header_fields(text, struct), struct
    base = "XLA_FFI_InternalExtension" if "struct XLA_FFI_InternalExtension {" in text else "XLA_FFI_Extension_Base"
    assert [n for n, _ in _xla_ffi.ExtensionBase._fields_] == _header_fields(text, base)
    # The API's function table may grow at its end and rename entries; the three called must keep their places.
    functions = _header_fields(text, "XLA_FFI_Api")
    ours = [name for name, _ in _xla_ffi.Api._fields_]
    assert len(functions) >= len(ours)
    for name in ("Error_Create", "Stream_Get", "DeviceOrdinal_Get"):
        assert functions[ours.index(name)] == name
    for name, value in [("XLA_FFI_Extension_Metadata", 1), ("XLA_FFI_ExecutionStage_EXECUTE", 3),
                        ("XLA_FFI_ArgType_BUFFER", 1), ("XLA_FFI_RetType_BUFFER", 1), ("XLA_FFI_AttrType_SCALAR", 3),
                        ("XLA_FFI_DataType_F16", 10), ("XLA_FFI_DataType_F32", 11), ("XLA_FFI_DataType_F64", 12),
                        ("XLA_FFI_DataType_BF16", 16), ("XLA_FFI_DataType_PRED", 1), ("XLA_FFI_Error_Code_INTERNAL", 13)]:
        assert _header_constant(text, name) == value, name


# --------------------------------------------------------------------------------------------
# CPU: jit and grad against jax.nn.dot_product_attention in float32.

CPU_SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal)
    (2, 17, 17, 4, 4, 40, False), (2, 17, 17, 4, 4, 40, True),
    (1, 113, 113, 2, 2, 64, True), (2, 17, 113, 6, 2, 40, True), (2, 17, 113, 6, 2, 40, False),
    (1, 113, 17, 4, 1, 32, False), (1, 1, 17, 2, 1, 8, True), (3, 33, 33, 3, 1, 24, True)]


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


def test_cpu_program_calls_the_ffi_targets(on_cpu):
    """Under jit the attention is an XLA custom call of the typed FFI, forward and backward."""
    q = _random((1, 8, 2, 16), 12)
    hlo = jax.jit(jax.grad(lambda q: flash_attn(q, q, q).sum())).lower(q).as_text()
    assert re.search(r"custom_call.*cupyflash_flash_attn_fwd", hlo)
    assert re.search(r"custom_call.*cupyflash_flash_attn_bwd", hlo)
    # The options travel as typed FFI attributes (mhlo.backend_config as a dictionary), the scale as f64.
    assert re.search(r"causal = false, softmax_scale = 2\.50*e-01 : f64", hlo)
    assert "callback" not in hlo  # no host callback in the program


def test_cpu_handler_errors_reach_python(on_cpu):
    """A Python exception in the handler becomes an XLA error carrying its message."""
    from cupyflash import jax as cfjax
    q = _random((1, 8, 2, 16), 13)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 2, 8), jnp.float32))
    call = jax.ffi.ffi_call(cfjax._FORWARD, results)
    with pytest.raises(Exception, match="cupyflash: KeyError: 'causal'"):
        jax.block_until_ready(call(q, q, q, softmax_scale=numpy.float64(0.25)))
    with pytest.raises(Exception, match="softmax_scale must be finite and positive"):
        jax.block_until_ready(call(q, q, q, softmax_scale=numpy.float64(-1.0), causal=numpy.bool_(False)))


@functools.cache
def _probe_target():
    """Registers (once per process: XLA refuses a second handler under one name) a CPU target that
    records what it gets and then asks for a CUDA stream."""
    seen = {}

    def probe(call):
        seen.update(ordinal=call.device_ordinal(), attrs=dict(call.attrs), shapes=[a.shape for a in call.args])
        call.cuda_stream()

    jax.ffi.register_ffi_target("cupyflash_test_probe", _xla_ffi.handler_capsule(probe), platform="cpu")
    return seen


def test_cpu_api_functions_and_attributes(on_cpu):
    """The API table entries the CUDA handlers call, reached from a probe target on the CPU backend:
    DeviceOrdinal_Get answers 0, Stream_Get answers XLA's own error (no GPU context), which the
    handler hands back to XLA as it is; scalar attributes of several types arrive decoded."""
    seen = _probe_target()
    seen.clear()
    x = jnp.ones((2, 3, 5), jnp.float32)
    call = jax.ffi.ffi_call("cupyflash_test_probe", jax.ShapeDtypeStruct((2,), jnp.float32))
    with pytest.raises(Exception, match="GPU context is not available"):
        jax.block_until_ready(call(x, x[0], i=numpy.int32(-7), f=numpy.float32(0.5), d=numpy.float64(0.1), b=True))
    assert seen == {"ordinal": 0, "attrs": {"b": True, "d": 0.1, "f": 0.5, "i": -7}, "shapes": [(2, 3, 5), (3, 5)]}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cpu_low_precision_buffers(on_cpu, dtype):
    """float16 and bfloat16 buffers cross the FFI with the right dtype: on the CPU the result is the
    float64 reference of the same inputs rounded to the dtype (within one ulp: eps relative, or the
    smallest subnormal)."""
    import ml_dtypes
    rng = numpy.random.default_rng(14)
    q, k, v = (reference.round_to(rng.standard_normal((1, 19, 2, 16)), dtype) for _ in range(3))
    got = jax.jit(functools.partial(flash_attn, causal=True))(*(jnp.asarray(x).astype(dtype) for x in (q, k, v)))
    assert got.dtype == jnp.dtype(dtype)
    want = reference.attention_forward(q, k, v, causal=True)[0]
    info = ml_dtypes.finfo(dtype)
    error = numpy.abs(numpy.asarray(got.astype(jnp.float32), numpy.float64) - want)
    assert numpy.all(error <= float(info.eps) * numpy.abs(want) + float(info.smallest_subnormal))


@pytest.mark.parametrize("args, error, match", [
    (((1, 8, 2, 16), (1, 8, 2), (1, 8, 2)), ValueError, "k must be 4-D"),
    (((1, 8, 3, 16), (1, 8, 2, 16), (1, 8, 2, 16)), ValueError, "multiple of k's nheads"),
    (((1, 8, 2, 12), (1, 8, 2, 12), (1, 8, 2, 12)), ValueError, "multiple of 8"),
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


# --------------------------------------------------------------------------------------------
# A small transformer trained under jit, with cupyflash.jax and with jax.nn.dot_product_attention.

VOCAB, DIM, HEADS, KV_HEADS, HEADDIM, LAYERS, SEQLEN, BATCH, STEPS = 32, 64, 4, 2, 16, 2, 48, 32, 20


def _init_model(key):
    keys = iter(jax.random.split(key, 3 + 6 * LAYERS))

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) * n_in ** -0.5

    params = {"embed": jax.random.normal(next(keys), (VOCAB, DIM), jnp.float32),
              "pos": jax.random.normal(next(keys), (SEQLEN, DIM), jnp.float32), "unembed": dense(DIM, VOCAB),
              "layers": []}
    for _ in range(LAYERS):
        params["layers"].append({
            "wq": dense(DIM, HEADS * HEADDIM), "wk": dense(DIM, KV_HEADS * HEADDIM),
            "wv": dense(DIM, KV_HEADS * HEADDIM), "wo": dense(HEADS * HEADDIM, DIM),
            "w1": dense(DIM, 4 * DIM), "w2": dense(4 * DIM, DIM)})
    return params


def _rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _loss(params, tokens, attention):
    batch, seqlen = tokens.shape
    x = params["embed"][tokens] + params["pos"][:seqlen]
    for layer in params["layers"]:
        h = _rms_norm(x)
        q = (h @ layer["wq"]).reshape(batch, seqlen, HEADS, HEADDIM)
        k = (h @ layer["wk"]).reshape(batch, seqlen, KV_HEADS, HEADDIM)
        v = (h @ layer["wv"]).reshape(batch, seqlen, KV_HEADS, HEADDIM)
        x = x + attention(q, k, v).reshape(batch, seqlen, HEADS * HEADDIM) @ layer["wo"]
        x = x + jax.nn.gelu(_rms_norm(x) @ layer["w1"]) @ layer["w2"]
    logits = _rms_norm(x) @ params["unembed"]
    # Next-token loss; the sequences repeat with period 3, so attention must look 2 tokens back.
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def _train(attention, steps=STEPS, lr=1e-2):
    """Losses of `steps` Adam steps, each one jitted step from the same initial parameters and data."""
    params = _init_model(jax.random.PRNGKey(0))
    period = jax.random.randint(jax.random.PRNGKey(1), (steps, BATCH, 3), 0, VOCAB)
    data = jnp.tile(period, (1, 1, SEQLEN // 3))
    moments = jax.tree.map(lambda p: (jnp.zeros_like(p), jnp.zeros_like(p)), params)

    @jax.jit
    def step(params, moments, tokens, t):
        loss, grads = jax.value_and_grad(_loss)(params, tokens, attention)

        def adam(p, g, m):
            m1, m2 = 0.9 * m[0] + 0.1 * g, 0.999 * m[1] + 0.001 * g * g
            update = (m1 / (1 - 0.9 ** t)) / (jnp.sqrt(m2 / (1 - 0.999 ** t)) + 1e-8)
            return p - lr * update, (m1, m2)

        pairs = jax.tree.map(adam, params, grads, moments, is_leaf=lambda x: isinstance(x, tuple))
        new_params = jax.tree.map(lambda pair: pair[0], pairs, is_leaf=lambda x: isinstance(x, tuple))
        new_moments = jax.tree.map(lambda pair: pair[1], pairs, is_leaf=lambda x: isinstance(x, tuple))
        return new_params, new_moments, loss

    losses = []
    for t in range(steps):
        params, moments, loss = step(params, moments, data[t], t + 1)
        losses.append(float(loss))
    return losses


def _attention_with(kind, dtype):
    """Attention on q, k, v rounded to `dtype`, result back in float32, by cupyflash or jax.nn."""
    def attention(q, k, v):
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        if kind == "cupyflash":
            out = flash_attn(q, k, v, causal=True)
        elif dtype == jnp.float32:  # the yardstick: float32 products, not TF32, on any GPU
            with jax.default_matmul_precision("highest"):
                out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        else:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return out.astype(jnp.float32)
    return attention


def _report_curves(name, curves, tmp_path):
    text = json.dumps(curves, indent=1)
    print(f"\n{name} loss curves:\n" + "\n".join(f"  {k:>16}: " + " ".join(f"{x:.4f}" for x in c)
                                               for k, c in curves.items()))
    out_dir = os.environ.get("CUPYFLASH_TEST_OUT") or str(tmp_path)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}_losses.json"), "w") as f:
        f.write(text)


def test_cpu_training_matches_dot_product_attention(on_cpu, tmp_path):
    """Both in float32: attention results differ by float32 rounding only (see _assert_close), so the
    two curves may drift apart by a few float32 ulps of the loss per step (about 2.4e-7 at loss 4);
    20 Adam steps at lr 1e-2 keep that far below 1e-5 of the initial loss (seen: 4.8e-7). A wrong
    gradient shows at the first update, at the scale of the per-step progress (~0.1)."""
    ours = _train(_attention_with("cupyflash", jnp.float32))
    theirs = _train(_attention_with("xla", jnp.float32))
    _report_curves("jax_cpu_float32", {"cupyflash": ours, "jax.nn (xla)": theirs}, tmp_path)
    assert ours[-1] < 0.5 * ours[0], "the model did not learn: the test would not tell a broken gradient"
    difference = max(abs(a - b) for a, b in zip(ours, theirs))
    assert difference <= 1e-5 * theirs[0], f"loss curves differ by {difference:.3g}"


# --------------------------------------------------------------------------------------------
# GPU: the kernels on XLA's stream, eager and under jit.

def _gpu():
    return jax.devices("gpu")[0]


def _poison_xla_memory():
    """Fills memory XLA's allocator will hand out next with NaN, so unwritten results show."""
    junk = jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32), _gpu())
    junk.block_until_ready()
    del junk


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


@pytest.mark.gpu
def test_gpu_training_matches_dot_product_attention(tmp_path):
    """Three curves from the same seed: cupyflash in bf16, jax.nn (XLA) in bf16, jax.nn in float32.
    Both bf16 runs see the same rounded q, k, v; the rule mirrors _check.py's: cupyflash's curve may
    be at most 2x farther from the float32 curve than jax.nn's bf16 curve is, plus one bf16 unit
    roundoff (2^-8) at the scale of the initial loss, for steps where both land near float32 by chance."""
    with jax.default_device(_gpu()):
        ours = _train(_attention_with("cupyflash", jnp.bfloat16))
        theirs = _train(_attention_with("xla", jnp.bfloat16))
        exact = _train(_attention_with("xla", jnp.float32))
    _report_curves("jax_gpu_bfloat16", {"cupyflash bf16": ours, "jax.nn bf16": theirs, "jax.nn float32": exact},
                   tmp_path)
    assert ours[-1] < 0.5 * ours[0], "the model did not learn"
    ours_off = max(abs(a - b) for a, b in zip(ours, exact))
    theirs_off = max(abs(a - b) for a, b in zip(theirs, exact))
    bound = 2 * theirs_off + 2.0 ** -8 * exact[0]
    assert ours_off <= bound, f"cupyflash is {ours_off:.3g} off the float32 curve, bound {bound:.3g}"
