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
from cupyflash.jax import (flash_attn, flash_attn_varlen, forward_with_lse,  # noqa: E402
                           varlen_forward_with_lse)

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
                        ("XLA_FFI_DataType_BF16", 16), ("XLA_FFI_DataType_PRED", 1), ("XLA_FFI_DataType_S32", 4),
                        ("XLA_FFI_DataType_U32", 8), ("XLA_FFI_Error_Code_INTERNAL", 13)]:
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
# CPU: the options and varlen. The handlers run the float64 reference on the float32 buffers and
# round once, so the comparisons with the reference check the plumbing (which attribute and
# operand reach which argument, the seed's words, dbias's routing to attn_bias) at float32 roundoff;
# jax.nn.dot_product_attention checks the mathematics where it can express the options.

OPTIONS = {
    "window": dict(window_size=(3, 1)),
    "window-left-only": dict(window_size=[2, -1]),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes="(nheads,)"),
    "alibi-per-batch": dict(alibi_slopes="(batch, nheads)"),
    "bias-full": dict(attn_bias="full"),
    "bias-heads": dict(attn_bias="heads"),
    "bias-keys": dict(attn_bias="keys"),
    "dropout-array-seed": dict(dropout_p=0.3, dropout_seed="array"),
    "dropout-int-seed": dict(dropout_p=0.3, dropout_seed=2 ** 63 + 12345),
    "deterministic": dict(deterministic=True),
    "all": dict(window_size=(4, 2), softcap=2.0, alibi_slopes="(batch, nheads)", attn_bias="full", dropout_p=0.25,
                dropout_seed="array", deterministic=True),
}
VARLEN_OPTIONS = {name: spec for name, spec in OPTIONS.items() if "bias" not in name}
VARLEN_OPTIONS["all"] = {name: value for name, value in OPTIONS["all"].items() if name != "attn_bias"}
OPTION_SHAPES = [(2, 9, 11, 4, 2, 16, False), (2, 9, 11, 4, 2, 16, True),
                 (1, 11, 7, 2, 1, 8, True)]  # rows that see no key
LENGTHS = ((3, 0, 6, 1), (4, 2, 5, 1))  # per-sequence (q, k) lengths of the varlen tests


def _make_options(spec, shape, seed):
    """flash_attn's keyword options: slopes float32 in [0.05, 0.55), float32 normal biases of the named
    shape, and a random uint32 (2,) dropout seed for 'array'."""
    batch, seqlen_q, seqlen_k, nheads = shape[:4]
    rng = numpy.random.default_rng(seed)
    options = dict(spec)
    if "alibi_slopes" in options:
        size = (nheads,) if options["alibi_slopes"] == "(nheads,)" else (batch, nheads)
        options["alibi_slopes"] = jnp.asarray(rng.uniform(0.05, 0.55, size).astype(numpy.float32))
    if "attn_bias" in options:
        size = {"full": (batch, nheads, seqlen_q, seqlen_k), "heads": (nheads, seqlen_q, seqlen_k),
                "keys": (seqlen_q, seqlen_k)}[options["attn_bias"]]
        options["attn_bias"] = jnp.asarray(rng.standard_normal(size).astype(numpy.float32))
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


def _mask_and_bias(seqlen_q, seqlen_k, causal, window_size, alibi_slopes, attn_bias):
    """jax.nn.dot_product_attention's mask and bias (4-D) for cupyflash's window/causal masks, ALiBi and
    attn_bias."""
    mask = jnp.asarray(reference.visible(seqlen_q, seqlen_k, causal, window_size=window_size))[None, None]
    distance = jnp.abs(jnp.arange(seqlen_k)[None, :] - jnp.arange(seqlen_q)[:, None] - (seqlen_k - seqlen_q))
    alibi = -alibi_slopes.reshape(-1, alibi_slopes.shape[-1], 1, 1) * distance
    return mask, alibi + attn_bias.reshape((1,) * (4 - attn_bias.ndim) + attn_bias.shape)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), (3, 1), (0, 4)], ids=str)
def test_cpu_window_alibi_bias_match_dot_product_attention(on_cpu, window, causal):
    """Window and causal as jax.nn's mask, ALiBi plus attn_bias as its bias, whose gradient is attn_bias's;
    under jit, with jax.grad of a nonlinear loss. Every row sees a key."""
    batch, sq, sk, h, hk, d = 2, 9, 12, 4, 2, 16
    q, k, v = _random((batch, sq, h, d), 25), _random((batch, sk, hk, d), 26), _random((batch, sk, hk, d), 27)
    options = _make_options(dict(alibi_slopes="(batch, nheads)", attn_bias="heads"), (batch, sq, sk, h), 28)
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
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype int32"):
        flash_attn_varlen(q, q, q, good.astype(jnp.float32), good, 5, 5)
    with pytest.raises(ValueError, match="same length"):
        flash_attn_varlen(q, q, q, good, jnp.asarray([0, 9], jnp.int32), 5, 9)
    with pytest.raises(ValueError, match="max_seqlen_k must be a static int"):
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
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        forward_with_lse(q, q, q, window=(1, 1))


def test_cpu_options_travel_as_attributes_and_operands(on_cpu):
    """Static options are FFI attributes (only those that are on), arrays are operands in a fixed order."""
    q = _random((1, 8, 2, 16), 40)
    bias, slopes, seed = jnp.zeros((2, 8, 8), jnp.float32), jnp.ones(2, jnp.float32), jnp.ones(2, jnp.uint32)

    def loss(q, bias, slopes, seed):
        return flash_attn(q, q, q, 0.25, True, window_size=(4, -1), softcap=3.0, alibi_slopes=slopes, attn_bias=bias,
                          dropout_p=0.5, dropout_seed=seed, deterministic=True).sum()

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(q, bias, slopes, seed).as_text()
    forward = re.search(r"custom_call @cupyflash_flash_attn_fwd\((.*?)\) \{.*?mhlo.backend_config = \{(.*?)\}", hlo)
    backward = re.search(r"custom_call @cupyflash_flash_attn_bwd\((.*?)\) \{.*?mhlo.backend_config = \{(.*?)\}", hlo)
    assert forward and backward, hlo
    assert forward.group(2) == ("causal = true, dropout_p = 5.000000e-01 : f64, has_alibi_slopes = true, "
                                "has_attn_bias = true, softcap = 3.000000e+00 : f64, softmax_scale = 2.500000e-01 : f64, "
                                "window_left = 4 : i64, window_right = -1 : i64")
    assert backward.group(2) == forward.group(2).replace("causal = true, ", "causal = true, deterministic = true, ")
    assert forward.group(1).count("%") == 6 and backward.group(1).count("%") == 9  # q, k, v, slopes, bias, seed
    plain = jax.jit(lambda q: flash_attn(q, q, q)).lower(q).as_text()
    assert re.search(r"mhlo.backend_config = \{causal = false, softmax_scale = 2\.50*e-01 : f64\}", plain)


def test_cpu_handler_checks_its_operand_count(on_cpu):
    from cupyflash import jax as cfjax
    q = _random((1, 8, 2, 16), 41)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 2, 8), jnp.float32))
    call = jax.ffi.ffi_call(cfjax._FORWARD, results)
    with pytest.raises(Exception, match="3 operands, expected 4: q, k, v, attn_bias"):
        jax.block_until_ready(call(q, q, q, softmax_scale=numpy.float64(0.25), causal=numpy.bool_(False),
                                   has_attn_bias=numpy.bool_(True)))


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


# --------------------------------------------------------------------------------------------
# GPU: the options and varlen through XLA, under _check.py's rule against the float64 reference.

GPU_OPTION_CASES = [
    Case(113, 200, 96, "float16", False, nheads=4, nheads_k=4, window=(37, 11)),
    Case(200, 113, 64, "bfloat16", True, nheads=4, nheads_k=2, softcap=1.5),
    Case(113, 200, 64, "bfloat16", True, nheads=4, nheads_k=1, alibi=True),
    Case(113, 150, 64, "bfloat16", False, bias="full"),
    Case(113, 150, 64, "float16", True, nheads=4, nheads_k=2, bias="heads"),
    Case(113, 150, 128, "bfloat16", False, batch=3, bias="keys", deterministic=True),
    Case(113, 200, 64, "float16", True, nheads=4, nheads_k=2, dropout_p=0.17),
    Case(257, 300, 128, "bfloat16", True, window=(100, 20), softcap=3.0, alibi=True, bias="full", dropout_p=0.1,
         deterministic=True),
    Case.packed((0, 1, 17, 113, 5), (3, 0, 17, 200, 5), 64, "bfloat16", True, nheads=4, nheads_k=2),
    Case.packed((0, 1, 17, 113, 5), (3, 0, 17, 200, 5), 64, "float16", False, nheads=4, nheads_k=2, window=(20, 5),
                alibi=True, dropout_p=0.2),
    Case.packed((1000, 17), (113, 1000), 128, "bfloat16", True, nheads=4, nheads_k=4, softcap=1.5,
                deterministic=True),
]


def _gpu_case_call(case, inputs):
    """(attention(q, k, v, *bias), forward_with_lse-like(q, k, v), the arrays) for a _check Case on the
    GPU: the dropout seed is the int of `inputs` (a constant of the program), the rest are operands."""
    dtype = jnp.bfloat16 if case.dtype == "bfloat16" else jnp.float16
    arrays = {n: jnp.asarray(inputs[n]).astype(dtype) for n in ("q", "k", "v", "dout")}
    options = dict(window_size=case.window, softcap=case.softcap, dropout_p=case.dropout_p,
                   deterministic=case.deterministic)
    if case.alibi:
        options["alibi_slopes"] = jnp.asarray(inputs["alibi_slopes"])
    if case.dropout_p:
        options["dropout_seed"] = inputs["seed"]
    if case.bias:  # 'heads' biases hold values of case.dtype and go in it; the others in float32
        arrays["attn_bias"] = jnp.asarray(inputs["attn_bias"]).astype(dtype if case.bias == "heads" else jnp.float32)
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


@pytest.mark.gpu
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", GPU_OPTION_CASES, ids=str)
def test_gpu_options_match_reference(case, jit):
    result, _ = _run_gpu_case(case, 44, jit)
    assert result.ok, f"{case}: {result.describe()}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", [Case(300, 300, 128, "bfloat16", True, nheads=8, nheads_k=2, deterministic=True,
                                       alibi=True, bias="keys"),
                                  Case.packed((300, 17, 200), (300, 500, 17), 64, "float16", False, nheads=4,
                                              nheads_k=1, deterministic=True)], ids=str)
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
    """cu_seqlens that XLA computes on the GPU in the same program, right before the call: the handler's
    host read waits for them (reading them early would see garbage or the previous packing)."""
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
