"""cupyflash.jax, the XLA typed FFI: the ctypes structures against the installed jaxlib's header, the
custom calls and their attributes in the lowered program, handler errors reaching Python, the API
functions reached from a probe target, and float16/bfloat16 buffers crossing the FFI (CPU backend);
the signature attribute; the traits each handler answers at registration, and the graph twins'
calls (the target, the scratch results, the results unchanged) with the GPU planning stubbed; the
CUDA handlers' plumbing with the GPU parts stubbed.
(The test_jax_*.py files are split by concern; test_jax_grad.py lists them.)
"""

import contextlib
import ctypes
import functools
import os
import re
import threading
import types

import numpy
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
pytest.register_assert_rewrite("jax_helpers")

from cupyflash import _config, _xla_ffi, reference  # noqa: E402
from cupyflash.jax import flash_attn  # noqa: E402
from jax_helpers import _random, on_cpu  # noqa: E402, F401

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
                        ("XLA_FFI_DataType_U32", 8), ("XLA_FFI_DataType_U8", 6), ("XLA_FFI_Error_Code_INTERNAL", 13)]:
        assert _header_constant(text, name) == value, name
    bit = re.search(r"\bXLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE\s*=\s*1u?\s*<<\s*(\d+)", text)
    assert bit and _xla_ffi.COMMAND_BUFFER_COMPATIBLE == 1 << int(bit.group(1))


def test_cpu_program_calls_the_ffi_targets(on_cpu):
    """Under jit the attention is an XLA custom call of the typed FFI, forward and backward."""
    q = _random((1, 8, 2, 16), 12)
    hlo = jax.jit(jax.grad(lambda q: flash_attn(q, q, q).sum())).lower(q).as_text()
    assert re.search(r"custom_call.*cupyflash_flash_attn_fwd", hlo)
    assert re.search(r"custom_call.*cupyflash_flash_attn_bwd", hlo)
    # The options travel as typed FFI attributes (mhlo.backend_config as a dictionary), the scale as f64.
    assert re.search(r"_signature = -?\d+ : i64, causal = false, softmax_scale = 2\.50*e-01 : f64", hlo)
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
    records what it gets, read both ways (the raw loads of the CUDA handlers' fast path and the
    full decoding), and then asks for a CUDA stream."""
    seen = {}

    def probe(call):
        seen.update(ordinal=call.device_ordinal(), attrs=dict(call.attrs), shapes=[a.shape for a in call.args],
                    args=call.arg_pointers() == [a.pointer for a in call.args],
                    rets=call.ret_pointers() == [r.pointer for r in call.rets],
                    first=(call.first_scalar(b"a"), call.first_scalar(b"b"), call.first_scalar(b"i")))
        call.cuda_stream()

    jax.ffi.register_ffi_target("cupyflash_test_probe", _xla_ffi.handler_capsule(probe), platform="cpu")
    return seen


def test_cpu_api_functions_and_attributes(on_cpu):
    """The API table entries the CUDA handlers call, reached from a probe target on the CPU backend:
    DeviceOrdinal_Get answers 0, Stream_Get answers XLA's own error (no GPU context), which the
    handler hands back to XLA as it is; scalar attributes of several types arrive decoded; the raw
    loads find the buffers' addresses and the first attribute (by name, and only an int64)."""
    seen = _probe_target()
    seen.clear()
    x = jnp.ones((2, 3, 5), jnp.float32)
    call = jax.ffi.ffi_call("cupyflash_test_probe", (jax.ShapeDtypeStruct((2,), jnp.float32),) * 2)
    with pytest.raises(Exception, match="GPU context is not available"):
        jax.block_until_ready(call(x, x[0], i=numpy.int64(-7), f=numpy.float32(0.5), d=numpy.float64(0.1), b=True,
                                   a=numpy.int64(-2 ** 62 - 3)))
    assert seen == {"ordinal": 0, "attrs": {"a": -2 ** 62 - 3, "b": True, "d": 0.1, "f": 0.5, "i": -7},
                    "shapes": [(2, 3, 5), (3, 5)], "args": True, "rets": True, "first": (-2 ** 62 - 3, None, None)}
    seen.clear()
    with pytest.raises(Exception, match="GPU context is not available"):
        jax.block_until_ready(call(x, b=numpy.bool_(True)))  # the first attribute is not an int64
    assert seen["first"] == (None, None, None)


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


def _backend_config(hlo, target):
    """(operands, attributes) of the first custom call of `target`, the attributes without the
    signature (which the call must have, first)."""
    found = re.search(r"custom_call @%s\((.*?)\) \{.*?mhlo.backend_config = \{(.*?)\}" % target, hlo)
    assert found, hlo
    attributes = re.fullmatch(r"_signature = -?\d+ : i64, (.*)", found.group(2))
    assert attributes, found.group(2)
    return found.group(1), attributes.group(1)


def test_cpu_options_travel_as_attributes_and_operands(on_cpu):
    """Static options are FFI attributes (only those that are on), arrays are operands in a fixed order."""
    q = _random((1, 8, 2, 16), 40)
    bias, slopes, seed = jnp.zeros((2, 8, 8), jnp.float32), jnp.ones(2, jnp.float32), jnp.ones(2, jnp.uint32)

    def loss(q, bias, slopes, seed):
        return flash_attn(q, q, q, 0.25, True, window_size=(4, -1), softcap=3.0, alibi_slopes=slopes, attn_bias=bias,
                          dropout_p=0.5, dropout_seed=seed, deterministic=True).sum()

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(q, bias, slopes, seed).as_text()
    forward, backward = _backend_config(hlo, "cupyflash_flash_attn_fwd"), _backend_config(hlo, "cupyflash_flash_attn_bwd")
    assert forward[1] == ("causal = true, dropout_p = 5.000000e-01 : f64, has_alibi_slopes = true, "
                          "has_attn_bias = true, softcap = 3.000000e+00 : f64, softmax_scale = 2.500000e-01 : f64, "
                          "window_left = 4 : i64, window_right = -1 : i64")
    # The bias is differentiated (argnums), so the backward returns its gradient.
    assert backward[1] == forward[1].replace("causal = true, ", "causal = true, deterministic = true, ").replace(
        "has_attn_bias = true, ", "has_attn_bias = true, return_dbias = true, ")
    assert forward[0].count("%") == 6 and backward[0].count("%") == 9  # q, k, v, slopes, bias, seed
    plain = jax.jit(lambda q: flash_attn(q, q, q)).lower(q).as_text()
    assert _backend_config(plain, "cupyflash_flash_attn_fwd")[1] == "causal = false, softmax_scale = 2.500000e-01 : f64"


def test_cpu_handler_checks_its_operand_count(on_cpu):
    from cupyflash import jax as cfjax
    q = _random((1, 8, 2, 16), 41)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 2, 8), jnp.float32))
    call = jax.ffi.ffi_call(cfjax._FORWARD, results)
    with pytest.raises(Exception, match="3 operands, expected 4: q, k, v, attn_bias"):
        jax.block_until_ready(call(q, q, q, softmax_scale=numpy.float64(0.25), causal=numpy.bool_(False),
                                   has_attn_bias=numpy.bool_(True)))


def test_cpu_signature_is_checked(on_cpu):
    """The signature attribute names everything a launch depends on: another shape, dtype or
    option gives another; the handlers refuse a call whose signature is not its own (the CUDA
    handlers find their cached launch by it)."""
    from cupyflash import jax as cfjax
    q = _random((1, 8, 2, 16), 42)

    def signature(q, **options):
        hlo = jax.jit(lambda q: flash_attn(q, q, q, **options)).lower(q).as_text()
        return re.search(r"_signature = (-?\d+) : i64", hlo).group(1)

    first, causal = signature(q), signature(q, causal=True)
    assert signature(q) == first
    assert len({first, causal, signature(q[:, :7]), signature(q.astype(jnp.float16)), signature(q, softmax_scale=0.3),
                signature(q, window_size=(3, 3))}) == 6
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 2, 8), jnp.float32))
    call = jax.ffi.ffi_call(cfjax._FORWARD, results)
    attrs = dict(softmax_scale=numpy.float64(0.25), causal=numpy.bool_(False))
    out, _ = call(q, q, q, **attrs, _signature=numpy.int64(first))
    assert numpy.array_equal(out, flash_attn(q, q, q))
    with pytest.raises(Exception, match="the _signature attribute does not match the call"):
        jax.block_until_ready(call(q, q, q, **attrs, _signature=numpy.int64(causal)))  # the causal call's


def _metadata_of(capsule):
    """(API version, traits) a handler answers when XLA asks for its metadata, as at registration."""
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_char_p)
    handler = _xla_ffi._Handler(get_pointer(capsule, None))
    metadata = _xla_ffi.Metadata(ctypes.sizeof(_xla_ffi.Metadata))
    base = _xla_ffi.ExtensionBase(ctypes.sizeof(_xla_ffi.MetadataExtension), 1, None)  # XLA_FFI_Extension_Metadata
    extension = _xla_ffi.MetadataExtension(base, ctypes.pointer(metadata))
    api = _xla_ffi.Api(ctypes.sizeof(_xla_ffi.Api), None, _xla_ffi.ApiVersion(ctypes.sizeof(_xla_ffi.ApiVersion), None,
                                                                             0, 99))
    frame = _xla_ffi.CallFrame(struct_size=_xla_ffi.CALL_FRAME_SIZE, api=ctypes.pointer(api),
                               extension_start=ctypes.cast(ctypes.pointer(extension),
                                                           ctypes.POINTER(_xla_ffi.ExtensionBase)))
    assert handler(ctypes.addressof(frame)) is None  # no error
    version = metadata.api_version
    return (version.major_version, version.minor_version), metadata.traits


def test_handlers_answer_their_traits_at_registration():
    """Every attention target has a graph twin on both platforms; the twins answer XLA's
    command-buffer trait (the bit of the installed header) and the others none, all with the API
    version the structures follow."""
    from cupyflash import jax as cfjax
    names = {cfjax._FORWARD, cfjax._BACKWARD, cfjax._VARLEN_FORWARD, cfjax._VARLEN_BACKWARD}
    graphs = {name + "_graph" for name in names}
    assert set(cfjax._handlers) == {(t, p) for t in names | graphs | {cfjax._KVCACHE} for p in ("cpu", "CUDA")}
    for (target, platform), capsule in cfjax._handlers.items():
        traits = _xla_ffi.COMMAND_BUFFER_COMPATIBLE if target in graphs else 0
        assert _metadata_of(capsule) == (_xla_ffi.API_VERSION, traits), (target, platform)


_SCRATCH = (1000, 24)  # the stubbed backward plan's scratch sizes


@pytest.fixture
def traced_for_a_gpu(monkeypatch):
    """Traces as for CUDA device 3, with the GPU planning stubbed: every plan's scratch is _SCRATCH
    for a backward, none for a forward; a head dim that is not a multiple of 8 gets no plan (the
    core pads it). Yields the launches kept for the handler."""
    from cupyflash import jax as cfjax

    def new_launch(request, operands, device, stream=None):
        assert device == 3 and stream is None and all(x.data.ptr == operands[0].data.ptr for x in operands)
        pads = operands[request.names.index("q")].shape[-1] % 8
        plan = None if pads else types.SimpleNamespace(scratch_sizes=_SCRATCH if request.pass_ == "bwd" else ())
        return cfjax._Launch(request, plan)

    class Placeholder:  # what planning reads of a placeholder
        def __init__(self, x):
            self.shape, self.data = x.shape, types.SimpleNamespace(ptr=512)

    launches = {}
    monkeypatch.setattr(cfjax, "_launches", launches)
    monkeypatch.setattr(cfjax, "_trace_device", lambda operands: 3)
    monkeypatch.setattr(cfjax, "_placeholders", lambda operands, device: [Placeholder(x) for x in operands])
    monkeypatch.setattr(cfjax, "_new_launch", new_launch)
    yield launches


def _custom_calls(hlo):
    """(target, result types, signature) of every custom call in a lowered program."""
    return [(target, results, int(signature)) for target, signature, results in re.findall(
        r"custom_call @(\w+)\(.*?_signature = (-?\d+) : i64.*?\) -> \((.*?)\)\n", hlo)]


def _fwd_bwd_values(q, k, v, dout):
    out, vjp = jax.vjp(functools.partial(flash_attn, causal=True), q, k, v)
    return out, vjp(dout)


def _fresh_jit(function):
    """jax.jit of a new function object: jit's trace cache, keyed by the function, would hand back
    a trace made before the test changed how calls are traced."""
    return jax.jit(lambda *args: function(*args))


def test_cpu_graph_twins_declare_scratch_results(on_cpu, traced_for_a_gpu, monkeypatch):
    """Traced for a GPU, float16/bfloat16 calls go to the graph twins: the backward's scratch
    (the plan's sizes) is declared as extra uint8 results, which the JAX side drops, and each launch
    is kept for the handler under the call's signature and the device. On the CPU the twins run the
    reference as the plain targets do: the same results, bit for bit."""
    from cupyflash import jax as cfjax
    q, k, v, dout = (_random((1, 24, 2, 16), 50 + i).astype(jnp.float16) for i in range(4))
    step = _fresh_jit(_fwd_bwd_values)
    calls = _custom_calls(step.lower(q, k, v, dout).as_text())
    assert [(t, r.count("ui8")) for t, r, _ in calls] == [("cupyflash_flash_attn_fwd_graph", 0),
                                                          ("cupyflash_flash_attn_bwd_graph", 2)]
    assert calls[1][1].endswith("tensor<1000xui8>, tensor<24xui8>")
    assert set(traced_for_a_gpu) == {(signature, 3, _config.forced_choices()) for _, _, signature in calls}
    assert all(launch.request.target == target for (target, _, _), launch in zip(calls, traced_for_a_gpu.values()))
    out, grads = step(q, k, v, dout)
    assert len(grads) == 3
    monkeypatch.setattr(cfjax, "_trace_device", lambda operands: None)  # traced for the CPU: the plain targets
    plain = _fresh_jit(_fwd_bwd_values)
    assert [t for t, _, _ in _custom_calls(plain.lower(q, k, v, dout).as_text())] == [
        "cupyflash_flash_attn_fwd", "cupyflash_flash_attn_bwd"]
    want_out, want_grads = plain(q, k, v, dout)
    for got, want in zip((out, *grads), (want_out, *want_grads)):
        assert got.dtype == want.dtype and numpy.array_equal(numpy.asarray(got), numpy.asarray(want))


def test_cpu_calls_that_allocate_keep_the_plain_targets(on_cpu, traced_for_a_gpu):
    """Traced for a GPU, the calls that allocate or copy stay on the targets without the trait: a
    differentiated bias's backward (dbias), a head dim the core pads, float32 (which the kernels
    refuse when the call runs)."""
    q = _random((1, 24, 2, 16), 55).astype(jnp.float16)
    bias = _random((2, 24, 24), 56)

    def targets(function, *args):
        return [target for target, _, _ in _custom_calls(_fresh_jit(function).lower(*args).as_text())]

    def loss(q, bias):
        return flash_attn(q, q, q, attn_bias=bias).astype(jnp.float32).sum()

    with_dbias = jax.grad(loss, argnums=(0, 1))
    assert targets(with_dbias, q, bias) == ["cupyflash_flash_attn_fwd_graph", "cupyflash_flash_attn_bwd"]
    constant_bias = jax.grad(lambda q: loss(q, bias))
    assert targets(constant_bias, q) == ["cupyflash_flash_attn_fwd_graph", "cupyflash_flash_attn_bwd_graph"]
    assert targets(_fwd_bwd_values, *(q[..., :12],) * 4) == ["cupyflash_flash_attn_fwd", "cupyflash_flash_attn_bwd"]
    assert targets(_fwd_bwd_values, *(q.astype(jnp.float32),) * 4) == ["cupyflash_flash_attn_fwd",
                                                                       "cupyflash_flash_attn_bwd"]


def test_cpu_varlen_graph_twins(on_cpu, traced_for_a_gpu, monkeypatch):
    """The varlen forward and backward go to their graph twins too, the backward with its scratch;
    the results are the plain targets', bit for bit."""
    from cupyflash import jax as cfjax
    from cupyflash.jax import flash_attn_varlen
    q, k, v, dout = (_random((40, 2, 16), 57 + i).astype(jnp.bfloat16) for i in range(4))
    cu = jnp.asarray([0, 15, 40], jnp.int32)

    def step(q, k, v, dout, cu):
        out, vjp = jax.vjp(lambda q, k, v: flash_attn_varlen(q, k, v, cu, cu, 25, 25, causal=True), q, k, v)
        return out, vjp(dout)

    graphed = _fresh_jit(step)
    calls = _custom_calls(graphed.lower(q, k, v, dout, cu).as_text())
    assert [(t, r.count("ui8")) for t, r, _ in calls] == [("cupyflash_flash_attn_varlen_fwd_graph", 0),
                                                          ("cupyflash_flash_attn_varlen_bwd_graph", 2)]
    out, grads = graphed(q, k, v, dout, cu)
    monkeypatch.setattr(cfjax, "_trace_device", lambda operands: None)
    want_out, want_grads = _fresh_jit(step)(q, k, v, dout, cu)
    for got, want in zip((out, *grads), (want_out, *want_grads)):
        assert numpy.array_equal(numpy.asarray(got), numpy.asarray(want))


class _FakeCall:
    """What the CUDA handler reads of a call, without XLA: addresses, attributes, shapes."""

    class Buffer:
        def __init__(self, shape, dtype, pointer):
            self.shape, self.dtype, self.pointer = shape, numpy.dtype(dtype), pointer
            self.nbytes = int(numpy.prod(shape)) * self.dtype.itemsize

        def cupy(self, device):
            return ("view", self.pointer, device)

    def __init__(self, target, attrs, args, rets, scratch=()):
        from cupyflash import jax as cfjax
        self.args = [self.Buffer(s, d, 1000 + 16 * i) for i, (s, d) in enumerate(args)]
        self.rets = [self.Buffer(s, d, 5000 + 16 * i) for i, (s, d) in enumerate([*rets, *(((n,), "uint8")
                                                                                             for n in scratch)])]
        self.attrs = dict(attrs, _signature=cfjax._signature(target, attrs, self.args, self.rets[:len(rets)]))

    def first_scalar(self, name):
        return self.attrs["_signature"] if name == b"_signature" else None

    def arg_pointers(self):
        return [a.pointer for a in self.args]

    def ret_pointers(self):
        return [r.pointer for r in self.rets]

    def cuda_stream(self):
        return 77

    def device_ordinal(self):
        return 0


def test_cuda_handler_plumbing_without_a_gpu(monkeypatch):
    """The CUDA handlers' Python with the GPU parts stubbed: the first call of a signature builds the
    plan (api.plan_of, on CuPy views); every call runs it with the operands' and results' addresses by
    the core's names and XLA's stream; the backward's scratch runs with XLA's stream current; dbias is
    copied into its result; a plan that cannot take the addresses falls back to the copying path."""
    cupy = pytest.importorskip("cupy")
    from cupyflash import api, jax as cfjax

    class Plan:
        def __init__(self, outputs, results):
            self.outputs, self.results, self.runs = outputs, results, []

        def allocates_on(self, stream, names):
            return any(name not in names for name in self.outputs)

        def run(self, arrays, seed, into, stream):
            self.runs.append((arrays, seed, into, stream, entered[:]))
            return self.results

    planned, copies, copying, entered = [], [], [], []
    monkeypatch.setattr(cfjax, "_launches", {})
    monkeypatch.setattr(cfjax, "_one_device", lambda: True)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cfjax._arrays, "external_stream", lambda stream, device: _entered(entered, stream))
    monkeypatch.setattr(cfjax, "_copy", lambda *args: copies.append(args))
    monkeypatch.setattr(cfjax, "_run_copying", lambda request, call, device, stream: copying.append(stream))
    monkeypatch.setattr(api, "plan_of", lambda *args: planned.append(args) or plans.pop(0))

    q, stats = ((1, 8, 2, 16), "bfloat16"), ((1, 2, 8), "float32")
    forward = cfjax._cuda_handler(cfjax._FORWARD, "fwd", False)
    call = _FakeCall(cfjax._FORWARD, dict(softmax_scale=0.25, causal=True), [q, q, q], [q, stats])
    plans = [Plan(["out", "lse"], (5000, 5016))]
    forward(call)
    forward(call)
    assert len(planned) == 1
    pass_, arrays, scale, causal, given, function, varlen, return_dbias = planned[0]
    assert (pass_, scale, causal, varlen, return_dbias) == ("fwd", 0.25, True, None, False)
    assert arrays == {n: ("view", 1000 + 16 * i, 0) for i, n in enumerate("qkv")}
    (launch,) = cfjax._launches.values()
    assert launch.plan.runs == [({"q": 1000, "k": 1016, "v": 1032}, None, {"out": 5000, "lse": 5016}, 77, [])] * 2

    backward = cfjax._cuda_handler(cfjax._BACKWARD, "bwd", False)
    bias = ((2, 8, 8), "float32")
    call = _FakeCall(cfjax._BACKWARD, dict(softmax_scale=0.25, causal=False, has_attn_bias=True, return_dbias=True),
                     [q, q, q, q, q, stats, bias], [q, q, q, bias])
    dbias = object()
    plans = [Plan(["dq", "dk", "dv", "dq_accum", "dbias"], (5000, 5016, 5032, dbias))]
    backward(call)
    arrays, given = planned[1][1], planned[1][4]
    assert list(arrays) == ["dout", "q", "k", "v", "out", "lse"] and given["attn_bias"] == ("view", 1096, 0)
    (run,) = cfjax._launches[call.attrs["_signature"], 0, _config.forced_choices()].plan.runs
    assert run[0] == {n: 1000 + 16 * i for i, n in enumerate(["dout", "q", "k", "v", "out", "lse", "attn_bias"])}
    assert run[2:] == ({"dq": 5000, "dk": 5016, "dv": 5032}, 77, [77])  # XLA's stream current for the scratch
    assert copies == [(5048, dbias, 77)] and not copying

    call = _FakeCall(cfjax._FORWARD, dict(softmax_scale=0.5, causal=False), [q, q, q], [q, stats])
    plans = [Plan(["out", "lse"], None)]  # an address the kernels cannot take
    forward(call)
    assert copying == [77]


@contextlib.contextmanager
def _entered(entered, stream):
    entered.append(stream)
    try:
        yield
    finally:
        entered.pop()


def test_cuda_graph_twin_plumbing_without_a_gpu(monkeypatch):
    """A graph twin's CUDA handler with the GPU parts stubbed: the backward runs its plan on XLA's
    scratch results (their addresses, by workspace) and enters no CuPy stream, since nothing
    allocates; a launch the program's tracing did not build, first called under XLA's capture, is
    built on another thread; scratch results too small for the plan (traced for another GPU) fall
    back to the plan's own scratch, which is refused under a capture."""
    pytest.importorskip("cupy")
    import cupy
    from cupyflash import api, jax as cfjax

    class Plan:
        scratch_sizes = (300, 100)

        def __init__(self):
            self.runs = []

        def allocates_on(self, stream, names):
            return True  # its own scratch

        def run(self, arrays, seed, into, stream, workspaces=None):
            self.runs.append((into, workspaces, entered[:]))
            return tuple(into.values())

    entered, planned_on, capturing = [], [], [True]
    monkeypatch.setattr(cfjax, "_launches", {})
    monkeypatch.setattr(cfjax, "_one_device", lambda: True)
    monkeypatch.setattr(cfjax, "_capturing", lambda stream: capturing[0])
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cfjax._arrays, "external_stream", lambda stream, device: _entered(entered, stream))
    monkeypatch.setattr(cfjax, "_run_copying", lambda *args: pytest.fail("copied"))
    monkeypatch.setattr(api, "plan_of", lambda *args: planned_on.append(threading.get_ident()) or Plan())

    q, stats = ((1, 8, 2, 16), "bfloat16"), ((1, 2, 8), "float32")
    backward = cfjax._cuda_handler(cfjax._BACKWARD + "_graph", "bwd", False)
    call = _FakeCall(cfjax._BACKWARD + "_graph", dict(softmax_scale=0.25, causal=True), [q] * 5 + [stats], [q] * 3,
                     scratch=(300, 356))
    backward(call)
    backward(call)
    assert planned_on and threading.get_ident() not in planned_on  # built off the capturing thread, once
    (launch,) = cfjax._launches.values()
    assert launch.request.scratch == (300, 356)
    assert launch.plan.runs == [({"dq": 5000, "dk": 5016, "dv": 5032}, [5048, 5064], [])] * 2

    capturing[0] = False
    call = _FakeCall(cfjax._BACKWARD + "_graph", dict(softmax_scale=0.5, causal=True), [q] * 5 + [stats], [q] * 3,
                     scratch=(300, 99))  # sized for another GPU
    backward(call)
    assert planned_on[-1] == threading.get_ident()  # not capturing: built here
    plan = cfjax._launches[call.attrs["_signature"], 0, _config.forced_choices()].plan
    assert plan.runs == [({"dq": 5000, "dk": 5016, "dv": 5032}, None, [77])]  # its own scratch, on XLA's stream
    capturing[0] = True
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture: its scratch results"):
        backward(call)

    forward = cfjax._cuda_handler(cfjax._FORWARD + "_graph", "fwd", False)
    call = _FakeCall(cfjax._FORWARD + "_graph", dict(softmax_scale=0.25, causal=True), [q] * 3, [q, stats])
    monkeypatch.setattr(Plan, "scratch_sizes", ())
    forward(call)
    plan = cfjax._launches[call.attrs["_signature"], 0, _config.forced_choices()].plan
    assert plan.runs == [({"out": 5000, "lse": 5016}, [], [])]


def test_plan_runs_on_given_workspaces_without_a_gpu():
    """Plan.run with the caller's workspaces (XLA's scratch results) at any address: each is aligned
    up to the plan's scratch alignment, its buffers' slots get that base plus their offsets, a
    zeroed one is zeroed on the stream before the launches, and nothing is allocated."""
    from cupyflash import _plan

    def refuse(arrays):
        raise AssertionError("allocated")

    events = []
    plan = _plan.Plan.__new__(_plan.Plan)
    plan.input_names, plan.alignments, plan.seed_slot, plan.maps, plan.hands_back = ["q"], [16], None, None, False
    plan.pointer_of, plan.stream_of = (lambda array: pytest.fail("read an array")), (lambda: pytest.fail("no stream"))
    plan.current_context = lambda: "context"
    plan.context, plan.lock = "context", threading.Lock()
    plan.result_names, plan.allocators = ["out"], [refuse]
    plan.workspaces = [_plan._Workspace(refuse, [(2, 0), (3, 512)], True, 1024, False),
                       _plan._Workspace(refuse, [(4, 0)], False, 96, True)]
    plan.slots, plan.scratch_offsets = [0, 1, 2, 3, 4], [[0, 512], [0]]
    plan.words = [0] * 5
    plan.memset = lambda *args: events.append(("memset", *args))
    plan.launch_kernel = lambda function, *args: events.append(("launch", function, args[7], list(plan.words)))
    plan.launches = [("bwd", (1, 1, 1), 128, 0, 0, None)]
    plan.finish = lambda outputs: (outputs["out"],)
    assert plan.run({"q": 4096}, None, {"out": 8192}, 77, workspaces=[10_000 + 8, 20_480]) == (8192,)
    words = [4096, 8192, 10_240, 10_752, 20_480]
    assert events == [("memset", 20_480, 0, 96, 77), ("launch", "bwd", 77, words)]
