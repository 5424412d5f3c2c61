"""cupyflash.torch: custom ops (opcheck), autograd against PyTorch's SDPA, torch.compile without graph
breaks, streams and allocator, the flash_attn drop-in, and a small Llama-style model trained end to end.

On the CPU the ops run the NumPy float64 reference, so everything but streams and the kernels' own
accuracy is exercised without a GPU; the same tests run on CUDA where one is visible (marker `gpu`).
"""

import contextlib
import copy
import json
import math
import os

import numpy
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cupyflash.torch as cft  # noqa: E402
from cupyflash import _check, reference  # noqa: E402
from cupyflash._check import Case  # noqa: E402

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = ["cpu", CUDA]
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal)
SHAPES = [(2, 17, 17, 2, 2, 16, False),
          (2, 17, 17, 4, 2, 32, True),    # GQA, causal
          (1, 13, 40, 6, 2, 8, True),     # causal with seqlen_q < seqlen_k
          (2, 40, 13, 4, 1, 16, True),    # MQA, causal with rows that see no key
          (1, 1, 1, 1, 1, 8, True)]
GPU_SHAPES = SHAPES + [(2, 300, 300, 8, 2, 64, True), (1, 129, 257, 4, 4, 128, False)]


def _ids(shape):
    b, sq, sk, h, hk, d, causal = shape
    return f"b{b}-sq{sq}-sk{sk}-h{h}/{hk}-d{d}{'-causal' if causal else ''}"


def _inputs(shape, dtype, device, seed):
    """q, k, v, dout as `dtype` tensors of rounded unit normals (float64 draws, so shared by every dtype)."""
    b, sq, sk, h, hk, d, _ = shape
    gen = torch.Generator().manual_seed(seed)
    sizes = [(b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).to(device) for s in sizes]


def sdpa_reference(q, k, v, softmax_scale=None, causal=False):
    """PyTorch's SDPA, math backend, in flash_attn's layout: kv heads repeated for GQA, causal aligned
    bottom-right (query i sees key j iff j <= i + seqlen_k - seqlen_q), rows that see no key give 0."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    k, v = (x.repeat_interleave(h // k.shape[2], dim=2) for x in (k, v))  # q head i uses kv head i // groups
    start = max(sq - sk, 0) if causal else 0  # the rows before `start` see no key (SDPA would give NaN)
    mask = None
    if causal:
        mask = torch.ones(sq - start, sk, dtype=torch.bool, device=q.device).tril(start + sk - sq)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q[:, start:].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=softmax_scale).transpose(1, 2)
    return torch.cat([out.new_zeros(b, start, h, d), out], dim=1)


def _run(fn, q, k, v, dout):
    """fn(q, k, v) and the gradients that loss.backward() gives for loss = sum(out * dout)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    (out * dout).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _max_error(x, ref):
    return (x.double() - ref.double()).abs().max().item()


# --------------------------------------------------------------------------------------------
# Gradients against SDPA

@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_cpu_float64_matches_sdpa(shape, scale):
    q, k, v, dout = _inputs(shape, torch.float64, "cpu", seed=1)
    causal = shape[-1]
    got = _run(lambda q, k, v: cft.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal), q, k, v, dout)
    ref = _run(lambda q, k, v: sdpa_reference(q, k, v, scale, causal), q, k, v, dout)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert x.dtype == torch.float64 and x.shape == r.shape
        assert _max_error(x, r) <= 1e-12 * (1 + r.abs().max().item()), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cpu_low_precision_is_the_reference_rounded(dtype):
    """CPU tensors of other dtypes (bfloat16 goes through float32 to NumPy) give the float64 result
    rounded once to the dtype: within one unit in the last place of each element."""
    shape = (2, 17, 23, 4, 2, 16, True)
    q, k, v, dout = _inputs(shape, dtype, "cpu", seed=2)
    got = _run(lambda q, k, v: cft.flash_attn_func(q, k, v, causal=True), q, k, v, dout)
    ref = _run(lambda q, k, v: sdpa_reference(q, k, v, causal=True), *(x.double() for x in (q, k, v, dout)))
    ulp = torch.finfo(dtype).eps
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert x.dtype == dtype, name
        assert bool(((x.double() - r).abs() <= ulp * r.abs() + 1e-30).all()), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=_ids)
def test_gpu_matches_sdpa_float64(shape, dtype):
    """The project's rule (cupyflash/_check.py) with SDPA float64 as the truth: the error is at most 2x
    (out) or 3x (gradients) that of the same attention done naively in the dtype, plus one ulp at the
    result's scale and 1/64 ulp at unit scale."""
    q, k, v, dout = _inputs(shape, dtype, "cuda", seed=3)
    causal = shape[-1]
    got = _run(lambda q, k, v: cft.flash_attn_func(q, k, v, causal=causal), q, k, v, dout)
    ref = _run(lambda q, k, v: sdpa_reference(q, k, v, causal=causal), *(x.double() for x in (q, k, v, dout)))
    name = str(dtype).removeprefix("torch.")
    host = [x.float().cpu().numpy() for x in (q, k, v, dout)]
    lowp = [reference.attention_forward_lowp(*host[:3], name, causal=causal),
            *reference.attention_backward_lowp(host[3], *host[:3], name, causal=causal)]
    for what, x, r, naive, factor in zip(("out", "dq", "dk", "dv"), got, ref, lowp, (2, 3, 3, 3)):
        assert x.dtype == dtype and x.device == q.device
        naive_error = numpy.abs(naive - r.cpu().numpy()).max()
        floor = UNIT_ROUNDOFF[dtype] * (r.abs().max().item() + 2.0 ** -6)
        error = _max_error(x, r)
        assert error <= factor * naive_error + floor, f"{what}: error {error:.3g}, naive {naive_error:.3g}"


@pytest.mark.parametrize("device", DEVICES)
def test_lse_is_returned_and_not_differentiable(device):
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    q, k, v, _ = _inputs((1, 20, 20, 2, 2, 32, True), dtype, device, seed=4)
    q.requires_grad_()
    out, lse, probs = cft.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None and out.requires_grad and not lse.requires_grad
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 20)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 32 ** -0.5
    scores = scores.masked_fill(torch.ones(20, 20, dtype=torch.bool, device=device).triu(1), -math.inf)
    assert _max_error(lse, scores.logsumexp(-1)) <= 1e-4  # float32 lse from float32 score sums


def test_packed_inputs_match_separate_ones():
    q, k, v, dout = _inputs((2, 19, 19, 4, 4, 16, True), torch.float64, "cpu", seed=5)
    ref = _run(lambda q, k, v: cft.flash_attn_func(q, k, v, causal=True), q, k, v, dout)
    qkv = torch.stack([q, k, v], dim=2).requires_grad_()
    out = cft.flash_attn_qkvpacked_func(qkv, causal=True)
    (out * dout).sum().backward()
    for x, r in zip([out, *qkv.grad.unbind(2)], ref):
        assert _max_error(x, r) <= 1e-12
    kv = torch.stack([k, v], dim=2).requires_grad_()
    qq = q.clone().requires_grad_()
    out = cft.flash_attn_kvpacked_func(qq, kv, causal=True)
    (out * dout).sum().backward()
    for x, r in zip([out, qq.grad, *kv.grad.unbind(2)], ref):
        assert _max_error(x, r) <= 1e-12


# --------------------------------------------------------------------------------------------
# torch.library: opcheck, fake tensors, torch.compile

@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    """Schema, fake (meta) implementations, autograd registration and AOT dispatch, on both ops, with the
    options off (the defaults: the ops' first signature) and on."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for shape in [(2, 17, 29, 4, 2, 16, True), (1, 33, 20, 2, 2, 32, False)]:
        q, k, v, dout = _inputs(shape, dtype, device, seed=6)
        causal = shape[-1]
        args = [x.requires_grad_() for x in (q, k, v)]
        torch.library.opcheck(torch.ops.cupyflash.flash_attn_forward.default, (*args, 0.25, causal))
        out, lse = torch.ops.cupyflash.flash_attn_forward(q, k, v, 0.25, causal)
        # The backward has no derivative of its own (no double backward): its inputs do not require grad.
        plain = [x.detach() for x in (dout, q, k, v, out, lse)]
        torch.library.opcheck(torch.ops.cupyflash.flash_attn_backward.default, (*plain, 0.25, causal))


def _option_args(shape, dtype, device, seed):
    """The forward op's option arguments after q, k, v, with every option on: (softmax_scale, causal,
    window_left, window_right, softcap, alibi_slopes, attn_bias, dropout_p, seed, deterministic)."""
    b, sq, sk, h, *_ = shape
    gen = torch.Generator().manual_seed(seed)
    alibi = torch.rand(b, h, generator=gen).mul(0.5).to(device)
    bias = torch.randn(h, sq, sk, generator=gen, dtype=torch.float64).to(dtype).to(device).requires_grad_()
    return (0.25, shape[-1], 7, 3, 1.5, alibi, bias, 0.3, torch.tensor(2 ** 40 + 12345), True)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_options(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ops = torch.ops.cupyflash
    for shape in [(2, 17, 29, 4, 2, 16, True), (1, 33, 20, 2, 2, 32, False)]:
        q, k, v, dout = _inputs(shape, dtype, device, seed=6)
        options = _option_args(shape, dtype, device, seed=6)
        args = [x.requires_grad_() for x in (q, k, v)]
        torch.library.opcheck(ops.flash_attn_forward.default, (*args, *options))
        out, lse = ops.flash_attn_forward(*args, *options)
        plain = [x.detach() for x in (dout, q, k, v, out, lse)]
        plain_options = [x.detach() if isinstance(x, torch.Tensor) else x for x in options]
        for return_dbias in (False, True):
            torch.library.opcheck(ops.flash_attn_backward.default, (*plain, *plain_options, return_dbias))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_varlen(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ops = torch.ops.cupyflash
    q, k, v, dout, cu_q, cu_k = _varlen_inputs(LENGTHS, 4, 2, 16, dtype, device, seed=6)
    lengths = (max(LENGTHS[0]), max(LENGTHS[1]))
    alibi = torch.rand(4).to(device)
    for options in [(0.25, True), (0.25, False, 3, 2, 1.5, alibi, 0.3, torch.tensor(99), True)]:
        args = [x.requires_grad_() for x in (q, k, v)]
        torch.library.opcheck(ops.flash_attn_varlen_forward.default, (*args, cu_q, cu_k, *lengths, *options))
        out, lse = ops.flash_attn_varlen_forward(*args, cu_q, cu_k, *lengths, *options)
        assert lse.shape == (4, sum(LENGTHS[0])) and lse.dtype == torch.float32
        plain = [x.detach() for x in (dout, q, k, v, out, lse)]
        torch.library.opcheck(ops.flash_attn_varlen_backward.default, (*plain, cu_q, cu_k, *lengths, *options))


def test_fake_tensors_give_shapes_dtypes_and_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 40, 3, 8, 64, dtype=torch.bfloat16)[:, :, 0]  # a strided view, like packed qkv
        k = v = torch.empty(2, 50, 4, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.cupyflash.flash_attn_forward(q, k, v, 0.125, True)
        dq, dk, dv, no_dbias = torch.ops.cupyflash.flash_attn_backward(out, q, k, v, out, lse, 0.125, True)
        bias = torch.empty(1, 8, 40, 50, dtype=torch.float32)
        *_, dbias = torch.ops.cupyflash.flash_attn_backward(out, q, k, v, out, lse, 0.125, True, attn_bias=bias,
                                                            return_dbias=True)
        packed_q, packed_kv = torch.empty(70, 8, 64, dtype=torch.float16), torch.empty(90, 2, 2, 64, dtype=torch.float16)
        cu = torch.empty(4, dtype=torch.int32)
        varlen_out, varlen_lse = torch.ops.cupyflash.flash_attn_varlen_forward(
            packed_q, packed_kv[:, 0], packed_kv[:, 1], cu, cu, 30, 40, 0.125, False)
        varlen_grads = torch.ops.cupyflash.flash_attn_varlen_backward(
            varlen_out, packed_q, packed_kv[:, 0], packed_kv[:, 1], varlen_out, varlen_lse, cu, cu, 30, 40, 0.125, False)
    assert out.shape == (2, 40, 8, 64) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (2, 8, 40) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert [g.shape for g in (dq, dk, dv)] == [(2, 40, 8, 64), (2, 50, 4, 64), (2, 50, 4, 64)]
    assert no_dbias.shape == (0,)
    assert dbias.shape == bias.shape and dbias.dtype == torch.float32 and dbias.is_contiguous()
    assert varlen_out.shape == (70, 8, 64) and varlen_out.dtype == torch.float16 and varlen_out.is_contiguous()
    assert varlen_lse.shape == (8, 70) and varlen_lse.dtype == torch.float32
    assert [g.shape for g in varlen_grads] == [(70, 8, 64), (90, 2, 64), (90, 2, 64)]
    assert all(g.is_contiguous() for g in varlen_grads)


def _attention_loss(q, k, v):
    out = cft.flash_attn_func(q, k, v, causal=True)
    return out.float().square().sum()


@pytest.mark.parametrize("device,backend", [("cpu", "aot_eager"), ("cpu", "inductor"),
                                            pytest.param("cuda", "inductor", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph(device, backend):
    torch._dynamo.reset()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, _ = _inputs((2, 17, 29, 4, 2, 16, True), dtype, device, seed=7)
    explanation = torch._dynamo.explain(_attention_loss)(q, k, v)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    graph_ops = [str(n.target) for g in explanation.graphs for n in g.graph.nodes]
    assert any("cupyflash.flash_attn_forward" in t for t in graph_ops), graph_ops

    compiled = torch.compile(_attention_loss, fullgraph=True, backend=backend)  # raises on any graph break
    eager = [x.clone().requires_grad_() for x in (q, k, v)]
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    loss_eager, loss = _attention_loss(*eager), compiled(*inputs)
    loss_eager.backward()
    loss.backward()
    torch.testing.assert_close(loss, loss_eager)
    for x, y in zip(inputs, eager):
        # The GPU backward adds dq with atomics, so it may differ by rounding from run to run.
        torch.testing.assert_close(x.grad, y.grad)


# --------------------------------------------------------------------------------------------
# The drop-in's options: window_size, softcap, alibi_slopes, attn_bias (cupyflash's own), dropout_p and
# deterministic, and the varlen functions. On the CPU the ops run the float64 NumPy reference, so the
# comparisons with it check the plumbing (which option reaches which argument, which seed the
# backward gets, which gradient autograd hands back, the packing); gradcheck and SDPA check the
# mathematics independently of the reference where they can express the options.

# Option specs; strings stand for tensors that _make_options builds for the call's shape.
OPTIONS = {
    "window": dict(window_size=(3, 1)),
    "window-left-only": dict(window_size=[2, -1]),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes="(nheads,)"),
    "alibi-per-batch": dict(alibi_slopes="(batch, nheads)"),
    "bias-full": dict(attn_bias="full"),
    "bias-heads": dict(attn_bias="heads"),
    "bias-keys-float32": dict(attn_bias="keys-float32"),
    "dropout": dict(dropout_p=0.3),
    "deterministic": dict(deterministic=True),
    "all": dict(window_size=(4, 2), softcap=2.0, alibi_slopes="(batch, nheads)", attn_bias="full", dropout_p=0.25,
                deterministic=True),
}
VARLEN_OPTIONS = {name: spec for name, spec in OPTIONS.items() if "bias" not in name}  # no attn_bias for varlen
VARLEN_OPTIONS["all"] = {name: value for name, value in OPTIONS["all"].items() if name != "attn_bias"}
OPTION_SHAPES = [(2, 9, 11, 4, 2, 16, False), (2, 9, 11, 4, 2, 16, True),
                 (1, 11, 7, 2, 1, 8, True)]  # rows that see no key
# Per-sequence lengths (q, k) of the varlen tests: an empty query side, and with causal rows that see no key.
LENGTHS = ((3, 0, 6, 1), (4, 2, 5, 1))


def _make_options(spec, shape, dtype, device, seed):
    """The keyword options of a drop-in call: alibi_slopes float32 in [0.05, 0.55); attn_bias of the named
    shape in `dtype` ('keys-float32': float32), requiring grad."""
    batch, seqlen_q, seqlen_k, nheads = shape[:4]
    gen = torch.Generator().manual_seed(seed)
    options = dict(spec)
    if "alibi_slopes" in options:
        size = (nheads,) if options["alibi_slopes"] == "(nheads,)" else (batch, nheads)
        options["alibi_slopes"] = (torch.rand(size, generator=gen) * 0.5 + 0.05).to(device)
    if "attn_bias" in options:
        kind = options["attn_bias"]
        size = {"full": (batch, nheads, seqlen_q, seqlen_k), "heads": (nheads, seqlen_q, seqlen_k),
                "keys-float32": (seqlen_q, seqlen_k)}[kind]
        bias = torch.randn(size, generator=gen, dtype=torch.float64).to(torch.float32 if "float32" in kind else dtype)
        options["attn_bias"] = bias.to(device).requires_grad_()
    return options


def _numpy(x):
    return None if x is None else x.detach().cpu().double().numpy()


def _reference_options(options, seed):
    """The reference's keyword options for a drop-in call's options and the seed it drew."""
    result = dict(window_size=tuple(options.get("window_size", (-1, -1))), softcap=options.get("softcap", 0.0),
                  alibi_slopes=_numpy(options.get("alibi_slopes")), dropout_p=options.get("dropout_p", 0.0), seed=seed)
    if options.get("attn_bias") is not None:
        result["attn_bias"] = _numpy(options["attn_bias"])
    return result


def _dropin(call, q, k, v, dout, options, torch_seed=0):
    """[out, lse, dq, dk, dv, dbias] of `call(q, k, v, return_attn_probs=True, **options)` after
    torch.manual_seed(torch_seed) (dbias None without attn_bias), and the dropout seed the call drew
    (None without dropout): after the same torch.manual_seed, draw_dropout_seed() gives it."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    bias = options.get("attn_bias")
    torch.manual_seed(torch_seed)
    seed = int(cft.draw_dropout_seed()) if options.get("dropout_p") else None
    torch.manual_seed(torch_seed)
    out, lse, probs = call(*leaves, return_attn_probs=True, **options)
    assert probs is None and out.requires_grad and not lse.requires_grad and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, leaves + ([] if bias is None else [bias]), dout)
    return [out.detach(), lse, *grads, *([None] if bias is None else [])], seed


def _reference(q, k, v, dout, softmax_scale, causal, options, seed):
    """[out, lse, dq, dk, dv, dbias] of the float64 reference."""
    args = [_numpy(x) for x in (q, k, v)]
    opts = _reference_options(options, seed)
    out, lse = reference.attention_forward(*args, softmax_scale, causal, **opts)
    return [out, lse, *reference.attention_backward(_numpy(dout), *args, softmax_scale, causal, return_dbias=True,
                                                     **opts)]


RESULT_NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


def _assert_matches(got, ref, names=RESULT_NAMES):
    """Each result within a few units of its dtype's roundoff of the float64 one, relative to the largest
    magnitude; -inf (lse of rows that see no key) exactly where the reference has it."""
    for name, x, r in zip(names, got, ref):
        if r is None:
            assert x is None, name
            continue
        r = torch.as_tensor(numpy.asarray(r, dtype=numpy.float64))
        x = x.detach().cpu()
        assert x.shape == r.shape, f"{name}: shape {tuple(x.shape)}, expected {tuple(r.shape)}"
        assert torch.equal(torch.isneginf(x.double()), torch.isneginf(r)), name
        finite = torch.isfinite(r)
        error = (x.double() - r)[finite].abs().max().item() if finite.any() else 0.0
        bound = 4 * torch.finfo(x.dtype).eps * (1 + r[finite].abs().max().item() if finite.any() else 1)
        assert error <= bound, f"{name}: error {error:.3g} > {bound:.3g}"


def _causal_call(function, softmax_scale, causal):
    return lambda *args, **kwargs: function(*args, softmax_scale=softmax_scale, causal=causal, **kwargs)


@pytest.mark.parametrize("shape", OPTION_SHAPES, ids=_ids)
@pytest.mark.parametrize("name", OPTIONS)
def test_cpu_options_match_reference(name, shape):
    q, k, v, dout = _inputs(shape, torch.float64, "cpu", seed=20)
    causal = shape[-1]
    options = _make_options(OPTIONS[name], shape, torch.float64, "cpu", seed=21)
    got, seed = _dropin(_causal_call(cft.flash_attn_func, 0.3, causal), q, k, v, dout, options, torch_seed=22)
    assert (seed is None) == (not options.get("dropout_p"))
    _assert_matches(got, _reference(q, k, v, dout, 0.3, causal, options, seed))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_low_precision_with_options(dtype):
    """Tensors of other dtypes with every option: the float64 result rounded once to the dtype (dbias to
    attn_bias's dtype, here q's)."""
    shape = OPTION_SHAPES[1]
    q, k, v, dout = _inputs(shape, dtype, "cpu", seed=23)
    options = _make_options(OPTIONS["all"], shape, dtype, "cpu", seed=24)
    got, seed = _dropin(_causal_call(cft.flash_attn_func, None, True), q, k, v, dout, options)
    assert all(x.dtype == dtype for x in got[:1] + got[2:])
    _assert_matches(got, _reference(q, k, v, dout, None, True, options, seed))


def sdpa_masked(q, k, v, softmax_scale, mask):
    """SDPA's math backend in flash_attn's layout, kv heads repeated, with an additive float mask."""
    h = q.shape[2]
    k, v = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, scale=softmax_scale).transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [(-1, -1), (3, 1), (0, 4)], ids=str)
def test_cpu_window_alibi_bias_match_sdpa(window, causal):
    """Window and causal masks, ALiBi and attn_bias as one SDPA attn_mask (float64), which also gives
    attn_bias's gradient; every row sees a key (SDPA would give NaN otherwise)."""
    shape = (2, 9, 12, 4, 2, 16, causal)
    b, sq, sk, h = shape[:4]
    q, k, v, dout = _inputs(shape, torch.float64, "cpu", seed=25)
    options = _make_options(dict(window_size=window, alibi_slopes="(batch, nheads)", attn_bias="heads"), shape,
                            torch.float64, "cpu", seed=26)
    got, _ = _dropin(_causal_call(cft.flash_attn_func, 0.3, causal), q, k, v, dout, options)

    visible = torch.from_numpy(reference.visible(sq, sk, causal, window_size=window))
    distance = (torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)).abs()
    alibi = -options["alibi_slopes"].double()[:, :, None, None] * distance
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, options["attn_bias"])]
    out = sdpa_masked(*leaves[:3], 0.3, (leaves[3] + alibi).masked_fill(~visible, -math.inf))
    ref = [out, *torch.autograd.grad(out, leaves, dout)]
    for name, x, r in zip(("out", "dq", "dk", "dv", "dbias"), got[:1] + got[2:], ref):
        assert x.shape == r.shape, name
        assert _max_error(x, r) <= 1e-12 * (1 + r.abs().max().item()), name


def test_cpu_gradcheck_with_every_option():
    """torch.autograd.gradcheck through the forward op at a fixed seed: the backward op is the derivative
    of the forward, dropout mask, softcap, ALiBi, window and attn_bias's gradient included."""
    shape = (1, 5, 6, 2, 1, 8, True)
    q, k, v, _ = _inputs(shape, torch.float64, "cpu", seed=27)
    scale, causal, left, right, softcap, alibi, bias, dropout_p, seed, deterministic = _option_args(
        (1, 5, 6, 2, 1, 8, False), torch.float64, "cpu", seed=28)
    left, right = 3, 2  # a window that cuts into the rows

    def attention(q, k, v, bias):
        return torch.ops.cupyflash.flash_attn_forward(q, k, v, scale, causal, left, right, softcap, alibi, bias,
                                                      dropout_p, seed, deterministic)[0]

    assert torch.autograd.gradcheck(attention, [x.requires_grad_() for x in (q, k, v)] + [bias])


def test_cpu_dropout_follows_torch_manual_seed():
    shape = (1, 9, 11, 2, 2, 16, True)
    q, k, v, dout = _inputs(shape, torch.float64, "cpu", seed=29)
    call = _causal_call(cft.flash_attn_func, None, True)
    (first, seed_first), (again, seed_again), (other, seed_other) = (
        _dropin(call, q, k, v, dout, dict(dropout_p=0.4), torch_seed=s) for s in (1, 1, 2))
    plain, _ = _dropin(call, q, k, v, dout, {}, torch_seed=1)
    assert seed_first == seed_again != seed_other
    for name, x, y, z, p in zip(RESULT_NAMES, first, again, other, plain):
        if name == "dbias":
            continue
        assert torch.equal(x, y), name
        if name == "lse":  # the log-sum-exp of the scores, before dropout
            assert torch.equal(x, z) and torch.equal(x, p)
        else:
            assert not torch.equal(x, z) and not torch.equal(x, p), name
    # Without dropout no seed is drawn: torch's generator is left as it was.
    torch.manual_seed(3)
    cft.flash_attn_func(q, k, v, causal=True)
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4))


def test_bad_options_are_refused_with_their_names():
    q, k, v, _ = _inputs((1, 8, 8, 2, 2, 16, False), torch.float32, "cpu", seed=8)
    cases = [(TypeError, "alibi_slopes must be a torch.Tensor", dict(alibi_slopes=[0.5, 0.25])),
             (TypeError, "alibi_slopes must have dtype float32", dict(alibi_slopes=torch.ones(2, dtype=torch.float64))),
             (ValueError, "alibi_slopes must have shape", dict(alibi_slopes=torch.ones(3))),
             (TypeError, "attn_bias must be a torch.Tensor", dict(attn_bias=numpy.zeros((8, 8)))),
             (ValueError, "attn_bias must broadcast", dict(attn_bias=torch.zeros(3, 8, 8))),
             (ValueError, "window_size", dict(window_size=(8,))),
             (ValueError, "window_size", dict(window_size=(-2, 0))),
             (ValueError, "softcap", dict(softcap=-1.0)),
             (TypeError, "softcap must be a number", dict(softcap="1")),
             (ValueError, "dropout_p", dict(dropout_p=1.0)),
             (TypeError, "deterministic must be a bool", dict(deterministic=1))]
    for error, match, options in cases:
        with pytest.raises(error, match=match):
            cft.flash_attn_func(q, k, v, **options)


def test_options_at_their_defaults_are_accepted():
    q, k, v, _ = _inputs((1, 8, 8, 2, 2, 16, False), torch.float64, "cpu", seed=9)
    plain = cft.flash_attn_func(q, k, v)
    spelled = cft.flash_attn_func(q, k, v, 0.0, None, False, [-1, -1], 0.0, None, False, False, attn_bias=None)
    assert torch.equal(plain, spelled)


# Varlen

def _varlen_inputs(lengths, nheads, nheads_k, headdim, dtype, device, seed):
    """q, k, v, dout packed (total, heads, headdim) and the int32 cu_seqlens of per-sequence (q, k) lengths."""
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lengths[0]), sum(lengths[1])
    sizes = [(total_q, nheads, headdim), (total_k, nheads_k, headdim), (total_k, nheads_k, headdim),
             (total_q, nheads, headdim)]
    tensors = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).to(device) for s in sizes]
    cu = [torch.tensor(numpy.cumsum((0,) + tuple(side)), dtype=torch.int32, device=device) for side in lengths]
    return (*tensors, *cu)


def _varlen_call(cu_q, cu_k, lengths, softmax_scale, causal):
    max_q, max_k = max(lengths[0]), max(lengths[1])
    return lambda q, k, v, **options: cft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                                 softmax_scale=softmax_scale, causal=causal, **options)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", VARLEN_OPTIONS)
def test_cpu_varlen_matches_reference(name, causal):
    q, k, v, dout, cu_q, cu_k = _varlen_inputs(LENGTHS, 4, 2, 16, torch.float64, "cpu", seed=30)
    shape = (len(LENGTHS[0]), max(LENGTHS[0]), max(LENGTHS[1]), 4)
    options = _make_options(VARLEN_OPTIONS[name], shape, torch.float64, "cpu", seed=31)
    got, seed = _dropin(_varlen_call(cu_q, cu_k, LENGTHS, 0.3, causal), q, k, v, dout, options)
    args = [_numpy(x) for x in (q, k, v)]
    opts = _reference_options(options, seed)
    ref_out, ref_lse = reference.attention_forward_varlen(*args, cu_q.numpy(), cu_k.numpy(), 0.3, causal, **opts)
    ref_grads = reference.attention_backward_varlen(_numpy(dout), *args, cu_q.numpy(), cu_k.numpy(), 0.3, causal,
                                                    **opts)
    assert got[1].shape == (4, sum(LENGTHS[0]))  # lse is (nheads, total_q)
    _assert_matches(got, [ref_out, ref_lse, *ref_grads, None])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cpu_varlen_is_dense_attention_per_sequence(causal):
    """Each sequence of a varlen call is a batch-1 flash_attn_func call on its rows (ALiBi slopes of its
    batch row, masks aligned to its own corner); rows of sequences without keys get zeros."""
    q, k, v, dout, cu_q, cu_k = _varlen_inputs(LENGTHS, 4, 2, 16, torch.float64, "cpu", seed=32)
    options = _make_options(dict(window_size=(2, 1), softcap=1.5, alibi_slopes="(batch, nheads)"),
                            (len(LENGTHS[0]), 0, 0, 4), torch.float64, "cpu", seed=33)
    got, _ = _dropin(_varlen_call(cu_q, cu_k, LENGTHS, None, causal), q, k, v, dout, options)
    expected = [torch.zeros_like(got[0]), torch.full_like(got[1], -math.inf), *(torch.zeros_like(g) for g in got[2:5])]
    for b in range(len(LENGTHS[0])):
        rows_q, rows_k = slice(*cu_q[b:b + 2].tolist()), slice(*cu_k[b:b + 2].tolist())
        if rows_q.start == rows_q.stop or rows_k.start == rows_k.stop:
            continue
        dense_options = dict(options, alibi_slopes=options["alibi_slopes"][b:b + 1])
        dense, _ = _dropin(_causal_call(cft.flash_attn_func, None, causal), q[None, rows_q], k[None, rows_k],
                           v[None, rows_k], dout[None, rows_q], dense_options)
        expected[0][rows_q], expected[1][:, rows_q] = dense[0][0], dense[1][0]
        expected[2][rows_q], expected[3][rows_k], expected[4][rows_k] = (g[0] for g in dense[2:5])
    for name, x, r in zip(RESULT_NAMES, got, expected):
        assert torch.equal(torch.isneginf(x), torch.isneginf(r)), name
        finite = torch.isfinite(r)
        assert _max_error(x[finite], r[finite]) <= 1e-12 * (1 + r[finite].abs().max().item()), name


def test_cpu_varlen_packed_forms_match_separate_ones():
    lengths = ((3, 6, 1), (3, 6, 1))
    q, k, v, dout, cu, _ = _varlen_inputs(lengths, 4, 4, 16, torch.float64, "cpu", seed=34)
    options = dict(window_size=(2, 0), softcap=1.5, dropout_p=0.2)
    ref, _ = _dropin(_varlen_call(cu, cu, lengths, None, True), q, k, v, dout, options, torch_seed=5)

    qkv = torch.stack([q, k, v], dim=1).requires_grad_()
    torch.manual_seed(5)
    out = cft.flash_attn_varlen_qkvpacked_func(qkv, cu, 6, causal=True, **options)
    (out * dout).sum().backward()
    for x, r in zip([out, *qkv.grad.unbind(1)], ref[:1] + ref[2:5]):
        assert torch.equal(x, r)

    kv = torch.stack([k, v], dim=1).requires_grad_()
    qq = q.clone().requires_grad_()
    torch.manual_seed(5)
    out = cft.flash_attn_varlen_kvpacked_func(qq, kv, cu, cu, 6, 6, causal=True, **options)
    (out * dout).sum().backward()
    for x, r in zip([out, qq.grad, *kv.grad.unbind(1)], ref[:1] + ref[2:5]):
        assert torch.equal(x, r)


def test_cpu_varlen_gradcheck():
    q, k, v, _, cu_q, cu_k = _varlen_inputs(((2, 0, 4), (3, 2, 3)), 2, 1, 8, torch.float64, "cpu", seed=35)
    alibi = torch.tensor([0.3, 0.1])

    def attention(q, k, v):
        return torch.ops.cupyflash.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 3, 0.5, True, 2, 0, 1.5, alibi,
                                                             0.3, torch.tensor(77), False)[0]

    assert torch.autograd.gradcheck(attention, [x.requires_grad_() for x in (q, k, v)])


def test_varlen_refusals():
    q, k, v, _, cu_q, cu_k = _varlen_inputs(LENGTHS, 2, 2, 16, torch.float32, "cpu", seed=36)
    max_q, max_k = max(LENGTHS[0]), max(LENGTHS[1])
    with pytest.raises(NotImplementedError, match="block_table"):
        cft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, block_table=torch.zeros(4, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32"):
        cft.flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, max_q, max_k)
    with pytest.raises(TypeError, match="cu_seqlens_k must be an int32 torch.Tensor"):
        cft.flash_attn_varlen_func(q, k, v, cu_q, cu_k.tolist(), max_q, max_k)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        cft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q - 1, max_k)
    with pytest.raises(ValueError, match="qkv must be 4-D"):
        cft.flash_attn_varlen_qkvpacked_func(q, cu_q, max_q)


FLASH_ATTN_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                      ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]


@pytest.mark.parametrize("function,leading,extra", [
    ("flash_attn_func", ["q", "k", "v"], [("attn_bias", None)]),
    ("flash_attn_qkvpacked_func", ["qkv"], [("attn_bias", None)]),
    ("flash_attn_kvpacked_func", ["q", "kv"], [("attn_bias", None)]),
    ("flash_attn_varlen_func", ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
     [("block_table", None)]),
    ("flash_attn_varlen_qkvpacked_func", ["qkv", "cu_seqlens", "max_seqlen"], []),
    ("flash_attn_varlen_kvpacked_func", ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"], []),
])
def test_drop_in_signatures_match_flash_attn(function, leading, extra):
    """The parameters of flash_attn 2.x's functions, in order, with its defaults; cupyflash's attn_bias
    comes after them and only by keyword."""
    import inspect
    parameters = list(inspect.signature(getattr(cft, function)).parameters.values())
    expected = [(name, inspect.Parameter.empty) for name in leading] + FLASH_ATTN_OPTIONS + extra
    assert [(p.name, p.default) for p in parameters] == expected
    for p in parameters:
        assert (p.kind == p.KEYWORD_ONLY) == (p.name == "attn_bias"), p.name


# torch.compile with the options

def _options_loss(q, k, v, alibi_slopes, attn_bias, dropout_p):
    out = cft.flash_attn_func(q, k, v, dropout_p, causal=True, window_size=(5, 2), softcap=2.0,
                              alibi_slopes=alibi_slopes, deterministic=True, attn_bias=attn_bias)
    return out.float().square().sum()


def _varlen_loss(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
    out = cft.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, 6, 5, causal=True, window_size=(3, 1),
                                     alibi_slopes=alibi_slopes)
    return out.float().square().sum()


def _compiled_and_eager(loss, device, backend, differentiable, args, torch_seed=1):
    """loss's value and the gradients of args[differentiable], eager and compiled with fullgraph=True,
    each after torch.manual_seed(torch_seed)."""
    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend=backend)):
        inputs = [x.detach().clone().requires_grad_() if i in differentiable else x for i, x in enumerate(args)]
        torch.manual_seed(torch_seed)
        value = fn(*inputs)
        results.append([value, *torch.autograd.grad(value, [inputs[i] for i in differentiable])])
    return results


@pytest.mark.parametrize("device,backend,dropout_p", [
    ("cpu", "aot_eager", 0.0), ("cpu", "aot_eager", 0.3), ("cpu", "inductor", 0.0),
    pytest.param("cuda", "inductor", 0.0, marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph_with_options(device, backend, dropout_p):
    """Every option under torch.compile, without a graph break, gives eager's loss and gradients (attn_bias's
    too). With dropout, aot_eager runs the seed's torch.randint as eager does (inductor draws it with
    its own generator: a different seed, see the next test)."""
    torch._dynamo.reset()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    shape = (2, 17, 29, 4, 2, 16, True)
    q, k, v, _ = _inputs(shape, dtype, device, seed=37)
    alibi, bias = _option_args(shape, dtype, device, seed=38)[5:7]
    explanation = torch._dynamo.explain(_options_loss)(q, k, v, alibi, bias, dropout_p)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    eager, compiled = _compiled_and_eager(_options_loss, device, backend, (0, 1, 2, 4),
                                          (q, k, v, alibi, bias, dropout_p))
    for x, y in zip(compiled, eager):
        torch.testing.assert_close(x, y)


def test_torch_compile_dropout_with_inductor_follows_manual_seed():
    torch._dynamo.reset()
    shape = (2, 17, 29, 4, 2, 16, True)
    q, k, v, _ = _inputs(shape, torch.float32, "cpu", seed=39)
    compiled = torch.compile(_options_loss, fullgraph=True, backend="inductor")
    losses = []
    for torch_seed, dropout_p in ((1, 0.3), (1, 0.3), (2, 0.3), (1, 0.0)):
        torch.manual_seed(torch_seed)
        losses.append(compiled(q, k, v, None, None, dropout_p))
    assert torch.equal(losses[0], losses[1])
    assert not torch.equal(losses[0], losses[2]) and not torch.equal(losses[0], losses[3])


@pytest.mark.parametrize("device,backend", [("cpu", "aot_eager"), pytest.param("cuda", "inductor", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph_varlen(device, backend):
    torch._dynamo.reset()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, _, cu_q, cu_k = _varlen_inputs(LENGTHS, 4, 2, 16, dtype, device, seed=40)
    alibi = torch.rand(4).to(device)
    explanation = torch._dynamo.explain(_varlen_loss)(q, k, v, cu_q, cu_k, alibi)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    eager, compiled = _compiled_and_eager(_varlen_loss, device, backend, (0, 1, 2), (q, k, v, cu_q, cu_k, alibi))
    for x, y in zip(compiled, eager):
        torch.testing.assert_close(x, y)


# --------------------------------------------------------------------------------------------
# The options and varlen on CUDA tensors, under the project's rule (cupyflash/_check.py).

GPU_OPTION_CASES = [
    Case(113, 200, 96, "float16", False, nheads=4, nheads_k=4, window=(37, 11)),
    Case(200, 113, 64, "bfloat16", True, nheads=4, nheads_k=2, softcap=1.5),
    Case(113, 200, 64, "bfloat16", True, nheads=4, nheads_k=1, alibi=True),
    Case(113, 150, 64, "bfloat16", False, bias="full"),
    Case(113, 150, 64, "float16", True, nheads=4, nheads_k=2, bias="heads"),
    Case(113, 150, 128, "bfloat16", False, batch=3, bias="keys", deterministic=True),
    Case(113, 200, 64, "float16", True, nheads=4, nheads_k=2, dropout_p=0.17),
    Case(200, 113, 128, "bfloat16", False, deterministic=True),
    Case(257, 300, 128, "bfloat16", True, window=(100, 20), softcap=3.0, alibi=True, bias="full", dropout_p=0.1,
         deterministic=True),
    Case.packed((0, 1, 17, 113, 5), (3, 0, 17, 200, 5), 64, "bfloat16", True, nheads=4, nheads_k=2),
    Case.packed((0, 1, 17, 113, 5), (3, 0, 17, 200, 5), 64, "float16", False, nheads=4, nheads_k=2, window=(20, 5),
                alibi=True, dropout_p=0.2),
    Case.packed((1000, 17), (113, 1000), 128, "bfloat16", True, nheads=4, nheads_k=4, softcap=1.5,
                deterministic=True),
]


def _run_gpu_case(case, seed, torch_seed=0):
    """cupyflash.torch's drop-in on CUDA tensors for `case` (autograd for the gradients, attn_bias's
    included), compared with the reference by _check.compare at the dropout seed the call drew."""
    inputs = _check.random_inputs(case, seed)
    dtype = getattr(torch, case.dtype)
    q, k, v, dout = (torch.from_numpy(inputs[n]).to("cuda", dtype) for n in ("q", "k", "v", "dout"))
    options = dict(softmax_scale=case.headdim ** -0.5, causal=case.causal, window_size=case.window,
                   softcap=case.softcap, dropout_p=case.dropout_p, deterministic=case.deterministic)
    if case.alibi:
        options["alibi_slopes"] = torch.from_numpy(inputs["alibi_slopes"]).cuda()
    if case.bias:  # 'heads' biases hold values of case.dtype and go in it; the others in float32
        bias_dtype = dtype if case.bias == "heads" else torch.float32
        options["attn_bias"] = torch.from_numpy(inputs["attn_bias"]).to("cuda", bias_dtype).requires_grad_()
    if case.varlen:
        cu_q, cu_k = (torch.from_numpy(c).cuda() for c in case.cu_seqlens())
        call = lambda q, k, v, **kw: cft.flash_attn_varlen_func(  # noqa: E731
            q, k, v, cu_q, cu_k, case.seqlen_q, case.seqlen_k, **kw)
    else:
        call = cft.flash_attn_func
    got, drawn = _dropin(call, q, k, v, dout, options, torch_seed)
    if case.dropout_p:
        inputs["seed"] = drawn
    assert all(x.device == q.device for x in got if x is not None)
    assert got[0].dtype == dtype and all(g.dtype == x.dtype for g, x in zip(got[2:5], (q, k, v)))
    if case.bias:
        assert got[5].dtype == options["attn_bias"].dtype and got[5].shape == options["attn_bias"].shape

    def host(x):
        return x.detach().float().cpu().numpy().astype(numpy.float64)

    grads = [host(g) for g in got[2:] if g is not None]
    return _check.compare(case, inputs, host(got[0]), host(got[1]), grads), got


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_OPTION_CASES, ids=str)
def test_gpu_options_match_reference(case):
    result, _ = _run_gpu_case(case, seed=41)
    assert result.ok, f"{case}: {result.describe()}"


@pytest.mark.gpu
def test_gpu_dropout_follows_torch_manual_seed():
    case = Case(113, 200, 64, "bfloat16", True, nheads=4, nheads_k=2, dropout_p=0.2)
    (_, first), (_, again), (_, other) = (_run_gpu_case(case, seed=42, torch_seed=s) for s in (1, 1, 2))
    for name, x, y, z in zip(RESULT_NAMES[:5], first, again, other):
        assert torch.equal(x, y), name  # the dropout mask and the deterministic parts are repeatable...
        assert torch.equal(x, z) if name == "lse" else not torch.equal(x, z), name  # ...and the seed matters


@pytest.mark.gpu
@pytest.mark.parametrize("case", [Case(300, 300, 128, "bfloat16", True, nheads=8, nheads_k=2, deterministic=True,
                                       alibi=True, bias="keys"),
                                  Case.packed((300, 17, 200), (300, 500, 17), 64, "float16", False, nheads=4,
                                              nheads_k=1, deterministic=True)], ids=str)
def test_gpu_deterministic_backward_is_bitwise_repeatable(case):
    runs = [_run_gpu_case(case, seed=43)[1] for _ in range(3)]
    for name, *values in zip(RESULT_NAMES, *runs):
        if values[0] is not None:
            assert all(torch.equal(values[0], x) for x in values[1:]), name


@pytest.mark.gpu
def test_gpu_varlen_packed_forms_take_views():
    """qkvpacked and kvpacked varlen calls equal the separate call on the same views, bit for bit."""
    lengths = ((77, 3, 150), (77, 3, 150))
    q, k, v, dout, cu, _ = _varlen_inputs(lengths, 4, 4, 64, torch.bfloat16, "cuda", seed=44)
    qkv = torch.stack([q, k, v], dim=1)
    options = dict(window_size=(9, 0), softcap=2.0, dropout_p=0.1)
    separate, _ = _dropin(_varlen_call(cu, cu, lengths, None, True), qkv[:, 0], qkv[:, 1], qkv[:, 2], dout, options)
    for packed_call in (lambda qkv: cft.flash_attn_varlen_qkvpacked_func(qkv, cu, 150, causal=True, **options),
                        lambda qkv: cft.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, 150, 150,
                                                                        causal=True, **options)):
        leaf = qkv.detach().clone().requires_grad_()
        torch.manual_seed(0)
        out = packed_call(leaf)
        (grad,) = torch.autograd.grad(out, leaf, dout)
        assert torch.equal(out, separate[0])
        for i in range(3):
            assert torch.equal(grad[:, i], separate[2 + i])


# --------------------------------------------------------------------------------------------
# CUDA: the caller's stream, torch's allocator

def _poison_torch_cache(shapes, copies=6):
    """Leave NaN in the blocks torch caches for the current stream, in the sizes about to be
    allocated, so that memory read before it is written shows up."""
    junk = [torch.full(shape, math.nan, device="cuda", dtype=torch.bfloat16) for shape in shapes for _ in range(copies)]
    del junk


@pytest.mark.gpu
def test_side_stream_ordering():
    """Forward and backward issued on a side stream, whose inputs are written only after a long sleep,
    while the default stream sleeps even longer: a kernel launched on any stream but the current
    one reads the inputs before they are written (other streams) or finishes after the side stream's
    results were read (the default stream)."""
    shape = (2, 256, 256, 4, 2, 64, True)
    # Pinned bfloat16 host tensors: copies from them are truly asynchronous (a pageable or converting
    # copy would make the host wait for the side stream's sleep, and hide a wrong stream).
    host = [x.pin_memory() for x in _inputs(shape, torch.bfloat16, "cpu", seed=10)]
    _run(cupyflash_attention, *(x.cuda() for x in host))  # compile and load the kernels outside the timed part
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU cycles on the default stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _poison_torch_cache([x.shape for x in host])  # torch caches blocks per stream: the side stream's
        q, k, v, dout = (torch.empty(x.shape, device="cuda", dtype=torch.bfloat16) for x in host)
        torch.cuda._sleep(200_000_000)
        for dst, src in zip((q, k, v, dout), host):
            dst.copy_(src, non_blocking=True)
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        out = cft.flash_attn_func(q, k, v, causal=True)
        out.backward(dout)
        results = [torch.full(x.shape, math.nan, dtype=torch.bfloat16).pin_memory() for x in (q, q, k, v)]
        for dst, src in zip(results, (out, q.grad, k.grad, v.grad)):
            dst.copy_(src, non_blocking=True)
    side.synchronize()  # not the device: only what was ordered on the side stream is complete
    ref = _run(lambda q, k, v: sdpa_reference(q, k, v, causal=True), *(x.double() for x in host))
    for name, x, r in zip(("out", "dq", "dk", "dv"), results, ref):
        error = _max_error(x, r)
        assert error <= 0.05 * r.abs().max().item(), f"{name}: error {error:.3g}"  # NaN fails too
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_outputs_come_from_torch_allocator():
    q, k, v, dout = _inputs((2, 128, 128, 4, 2, 64, True), torch.bfloat16, "cuda", seed=11)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    before = torch.cuda.memory_allocated()
    out, lse, _ = cft.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.cuda.memory_allocated() - before >= out.nbytes + lse.nbytes
    before = torch.cuda.memory_allocated()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.cuda.memory_allocated() - before >= dq.nbytes + dk.nbytes + dv.nbytes
    assert all(g.device == q.device and g.dtype == q.dtype for g in (dq, dk, dv))


# --------------------------------------------------------------------------------------------
# A small Llama-style decoder trained end to end

LLAMA = dict(vocab=64, hidden=256, layers=2, heads=8, kv_heads=2, head_dim=32, ffn=688, seqlen=128, batch=8,
             steps=20, lr=1e-3)
LLAMA_CPU = dict(LLAMA, seqlen=64, batch=2)  # the NumPy reference is slow: fewer tokens on the CPU


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x, cos, sin):
    """Rotary embedding on (batch, seqlen, heads, headdim), halves rotated as in Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class DecoderLayer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.attn_norm, self.mlp_norm = RMSNorm(c["hidden"]), RMSNorm(c["hidden"])
        self.qkv = torch.nn.Linear(c["hidden"], (c["heads"] + 2 * c["kv_heads"]) * c["head_dim"], bias=False)
        self.o = torch.nn.Linear(c["heads"] * c["head_dim"], c["hidden"], bias=False)
        self.gate_up = torch.nn.Linear(c["hidden"], 2 * c["ffn"], bias=False)
        self.down = torch.nn.Linear(c["ffn"], c["hidden"], bias=False)

    def forward(self, x, cos, sin, attention):
        b, s, _ = x.shape
        h, hk, d = self.c["heads"], self.c["kv_heads"], self.c["head_dim"]
        q, k, v = self.qkv(self.attn_norm(x)).split([h * d, hk * d, hk * d], dim=-1)
        # v stays a strided view of the qkv projection: the kernels read it in place.
        q, k, v = rotate(q.view(b, s, h, d), cos, sin), rotate(k.view(b, s, hk, d), cos, sin), v.view(b, s, hk, d)
        x = x + self.o(attention(q, k, v).reshape(b, s, h * d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Decoder(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = torch.nn.Embedding(c["vocab"], c["hidden"])
        self.layers = torch.nn.ModuleList(DecoderLayer(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"])
        self.head = torch.nn.Linear(c["hidden"], c["vocab"], bias=False)
        inv_freq = 10000.0 ** (-torch.arange(0, c["head_dim"], 2, dtype=torch.float64) / c["head_dim"])
        angles = torch.outer(torch.arange(c["seqlen"], dtype=torch.float64), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos().float()[:, None, :], persistent=False)
        self.register_buffer("sin", angles.sin().float()[:, None, :], persistent=False)

    def loss(self, tokens, attention):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, attention)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def cupyflash_attention(q, k, v):
    return cft.flash_attn_func(q, k, v, causal=True)


def sdpa_attention(q, k, v):
    """PyTorch's SDPA; kv heads repeated for GQA."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


# Each run: (attention, SDPA backends allowed, compute dtype). The last three are PyTorch's own: its
# default backend and its math backend in bfloat16, and float32 as the truth.
RUNS = {"cupyflash_bf16": ("cupyflash", None, torch.bfloat16),
        "sdpa_bf16": ("sdpa", None, torch.bfloat16),
        "sdpa_math_bf16": ("sdpa", SDPBackend.MATH, torch.bfloat16),
        "sdpa_fp32": ("sdpa", None, torch.float32)}


def _batch(c, device, seed):
    """One fixed batch of tokens, trained on at every step. With a 64-token vocabulary a token says
    little about the next one, so memorising the batch needs attention over the context: the loss
    falls fast, and through attention's gradients (with dq zeroed it lags by tenths)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, c["vocab"], (c["batch"], c["seqlen"]), generator=gen).to(device)


def train(model, step_loss, attention, backend, compute_dtype, tokens, c):
    """AdamW on a copy of `model` with float32 master weights and `compute_dtype` autocast. Returns
    the loss at each step and the float32 gradients of the first step."""
    model = copy.deepcopy(model)
    loss_of = step_loss(model, attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=c["lr"], weight_decay=0.0)
    losses, first_grads = [], None
    with sdpa_kernel(backend) if backend else contextlib.nullcontext():
        for _ in range(c["steps"]):
            with torch.autocast(tokens.device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
                loss = loss_of(tokens)
            loss.backward()
            if first_grads is None:
                first_grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses, first_grads


def compare_runs(runs):
    """The checks, in the project's rule (cupyflash/_check.py) applied to a whole model, with PyTorch's
    own bfloat16 attention as "the same computation in low precision" and float32 as the truth.

    Gradients of the first step, per parameter: cupyflash's distance from float32 is at most 3x the
    larger of the two SDPA bfloat16 runs' distances. Loss curves: bfloat16 arithmetic moves a
    curve by `spread`, the larger of max|sdpa_bf16 - fp32| and max|sdpa_math_bf16 - sdpa_bf16|
    over the steps; cupyflash's curve stays within 3x that of sdpa_bf16's. (Tried on the CPU
    configuration: dq scaled by 0.9 or dv by 1.05 fails the gradient checks, dq = 0 fails both.)
    Returns a list of (what, value, bound)."""
    losses = {n: numpy.array(r[0]) for n, r in runs.items()}
    grads = {n: r[1] for n, r in runs.items()}
    checks = []
    for name, truth in grads["sdpa_fp32"].items():
        error = {n: (grads[n][name] - truth).norm().item() for n in RUNS if n != "sdpa_fp32"}
        checks.append((f"grad {name}", error["cupyflash_bf16"],
                       3 * max(error["sdpa_bf16"], error["sdpa_math_bf16"])))
    spread = max(numpy.abs(losses["sdpa_bf16"] - losses["sdpa_fp32"]).max(),
                 numpy.abs(losses["sdpa_math_bf16"] - losses["sdpa_bf16"]).max())
    checks.append(("loss curve", numpy.abs(losses["cupyflash_bf16"] - losses["sdpa_bf16"]).max(), 3 * spread))
    return checks


def _report(test, runs, checks):
    """Prints the loss curves and the checks (pytest -s shows them); with CUPYFLASH_LOSS_CURVES set,
    appends them to that file as a JSON line."""
    names = list(runs)
    lines = [f"{test}\nstep " + " ".join(f"{n:>15}" for n in names)]
    lines += [f"{step:4d} " + " ".join(f"{runs[n][0][step]:15.6f}" for n in names) for step in range(len(runs[names[0]][0]))]
    lines += [f"{what}: {value:.4g} (bound {bound:.4g}){'' if value <= bound else ' FAIL'}" for what, value, bound in checks]
    print("\n" + "\n".join(lines))
    path = os.environ.get("CUPYFLASH_LOSS_CURVES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "losses": {n: runs[n][0] for n in names},
                                "checks": [[w, float(v), float(b)] for w, v, b in checks]}) + "\n")


@pytest.fixture
def one_torch_thread():
    """On the CPU, torch's busy-waiting threads and the reference's BLAS threads fight over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_and_compare(test, model, step_loss, c, device):
    tokens = _batch(c, device, seed=1)
    runs = {name: train(model, step_loss, attention, backend, dtype, tokens, c)
            for name, (attention, backend, dtype) in RUNS.items()}
    checks = compare_runs(runs)
    _report(test, runs, checks)
    first, last = runs["sdpa_bf16"][0][0], runs["sdpa_bf16"][0][-1]
    assert last < first / 2, "the model does not train, so the comparison would mean little"
    failed = [f"{what}: {value:.4g} > {bound:.4g}" for what, value, bound in checks if not value <= bound]
    assert not failed, failed


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("device", DEVICES)
def test_llama_training_matches_sdpa(device, request):
    """20 AdamW steps of a 2-layer Llama-style decoder (GQA 8/2 heads of 32, causal, rotary, SwiGLU,
    RMSNorm; float32 weights, bfloat16 autocast) with cupyflash and with SDPA, same start and data."""
    c = LLAMA_CPU if device == "cpu" else LLAMA
    torch.manual_seed(0)
    model = Decoder(c).to(device)
    attentions = {"cupyflash": cupyflash_attention, "sdpa": sdpa_attention}
    step_loss = lambda m, attention: lambda tokens: m.loss(tokens, attentions[attention])  # noqa: E731
    _train_and_compare(request.node.name, model, step_loss, c, device)


# The same with transformers' LlamaForCausalLM, cupyflash plugged in through its AttentionInterface.

def _check_causal_only(mask, seqlen_q, seqlen_k):
    """cupyflash gets causal=True and no mask: fail loudly if the model meant anything else."""
    if mask is None:
        return
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=mask.device).tril(seqlen_k - seqlen_q)
    visible = mask if mask.dtype == torch.bool else mask == 0
    assert bool((visible == allowed).all()), "the model asked for a mask other than the causal one"


def hf_cupyflash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract: (batch, heads, seqlen, headdim) in, (batch, seqlen,
    heads, headdim) out, and the attention weights (none here)."""
    _check_causal_only(attention_mask, query.shape[2], key.shape[2])
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as transformers' flash_attn path does: rotary left q, k in float32
        query, key, value = (x.to(torch.get_autocast_dtype(device)) for x in (query, key, value))
    out = cft.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                              dropout_p=dropout, softmax_scale=scaling, causal=True)
    return out, None


HF_NAMES = {"cupyflash": "cupy_attention", "sdpa": "sdpa"}  # a name with "flash" in it means flash_attn to transformers


def _hf_step_loss(model, attention):
    name = HF_NAMES[attention]
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
    return lambda tokens: model(input_ids=tokens, labels=tokens).loss


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("device", DEVICES)
def test_transformers_llama_training_matches_sdpa(device, request):
    transformers = pytest.importorskip("transformers", minversion="4.48")  # AttentionInterface
    transformers.AttentionInterface.register(HF_NAMES["cupyflash"], hf_cupyflash_attention)
    c = LLAMA_CPU if device == "cpu" else LLAMA
    config = transformers.LlamaConfig(
        vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["ffn"], num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
        max_position_embeddings=c["seqlen"], attention_dropout=0.0, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    _train_and_compare(request.node.name, model, _hf_step_loss, c, device)
