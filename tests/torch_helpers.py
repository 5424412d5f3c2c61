"""Helpers shared by the test_torch_*.py files: input makers, PyTorch's SDPA as a reference, the drop-in
call with its gradients, comparisons with the float64 reference, and the option matrix
(tests/option_cases.py) in cupyflash.torch's spelling."""

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupyflash.torch as cft
import cupyflash.options  # noqa: E402
from cupyflash import _check

import option_cases


# The option matrix (tests/option_cases.py) as cupyflash.torch spells it.
OPTIONS = option_cases.torch_options()
VARLEN_OPTIONS = option_cases.varlen_options(OPTIONS)
OPTION_SHAPES, LENGTHS = option_cases.OPTION_SHAPES, option_cases.LENGTHS


CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = ["cpu", CUDA]
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _lse_dtype(dtype):
    """lse's dtype: float32, float64 for float64 inputs (the NumPy path keeps them)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def _option_args(shape, dtype, device, seed):
    """The forward op's option arguments after q, k, v, with every option on: (softmax_scale, causal,
    window_left, window_right, softcap, alibi_slopes, attn_bias, dropout_p, seed, deterministic)."""
    b, sq, sk, h, *_ = shape
    gen = torch.Generator().manual_seed(seed)
    alibi = torch.rand(b, h, generator=gen).mul(0.5).to(device)
    bias = torch.randn(h, sq, sk, generator=gen, dtype=torch.float64).to(dtype).to(device).requires_grad_()
    return (0.25, shape[-1], 7, 3, 1.5, alibi, bias, 0.3, torch.tensor(2 ** 40 + 12345), True)


def _make_options(spec, shape, dtype, device, seed):
    """The keyword options of a drop-in call for a matrix entry (option_cases): arrays from the options'
    examples in the named form; attn_bias in `dtype` ('keys-float32': float32), requiring grad."""
    batch, seqlen_q, seqlen_k, nheads = shape[:4]
    rng = numpy.random.default_rng(seed)
    options = dict(spec)
    for name, form in spec.items():
        option = cupyflash.options.by_name(name)
        if option.kind == "array":
            array = torch.from_numpy(option.example(rng, (batch, nheads, seqlen_q, seqlen_k),
                                                    form.removesuffix("-float32"))).to(device)
            if option.gradient:  # in q's dtype but for the '-float32' form, requiring grad
                array = array.to(torch.float32 if form.endswith("-float32") else dtype).requires_grad_()
            options[name] = array
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
    assert probs is None and out.requires_grad and not lse.requires_grad and lse.dtype == _lse_dtype(q.dtype)
    grads = torch.autograd.grad(out, leaves + ([] if bias is None else [bias]), dout)
    return [out.detach(), lse, *grads, *([None] if bias is None else [])], seed


RESULT_NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


def _assert_matches(got, ref, names=RESULT_NAMES):
    """Each result within a few units of its dtype's roundoff of the float64 one, relative to the largest
    magnitude (8: the gradients' sums run in another order); -inf (lse of rows that see no key) exactly
    where the reference has it."""
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
        bound = 8 * torch.finfo(x.dtype).eps * (1 + r[finite].abs().max().item() if finite.any() else 1)
        assert error <= bound, f"{name}: error {error:.3g} > {bound:.3g}"


def _causal_call(function, softmax_scale, causal):
    return lambda *args, **kwargs: function(*args, softmax_scale=softmax_scale, causal=causal, **kwargs)


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


def _run_gpu_case(case, seed, torch_seed=0):
    """cupyflash.torch's drop-in on CUDA tensors for `case` (autograd for the gradients, attn_bias's
    included), compared with the reference by _check.compare at the dropout seed the call drew."""
    inputs = _check.random_inputs(case, seed)
    dtype = getattr(torch, case.dtype)
    q, k, v, dout = (torch.from_numpy(inputs[n]).to("cuda", dtype) for n in ("q", "k", "v", "dout"))
    options = dict(softmax_scale=case.headdim ** -0.5, causal=case.causal)
    for name, setting in case.options:  # arrays float32, but 'heads' biases (values of case.dtype) in it
        if cupyflash.options.by_name(name).kind == "array":
            array = torch.from_numpy(inputs[name]).to("cuda", dtype if setting == "heads" else torch.float32)
            options[name] = array.requires_grad_() if cupyflash.options.by_name(name).gradient else array
        else:
            options[name] = setting
    if case.varlen:
        cu_q, cu_k = (torch.from_numpy(c).cuda() for c in case.cu_seqlens())
        call = lambda q, k, v, **kw: cft.flash_attn_varlen_func(  # noqa: E731
            q, k, v, cu_q, cu_k, case.seqlen_q, case.seqlen_k, **kw)
    else:
        call = cft.flash_attn_func
    got, drawn = _dropin(call, q, k, v, dout, options, torch_seed)
    if case.setting("dropout_p"):
        inputs["seed"] = drawn
    assert all(x.device == q.device for x in got if x is not None)
    assert got[0].dtype == dtype and all(g.dtype == x.dtype for g, x in zip(got[2:5], (q, k, v)))
    if case.setting("attn_bias"):
        assert got[5].dtype == options["attn_bias"].dtype and got[5].shape == options["attn_bias"].shape

    def host(x):
        return x.detach().float().cpu().numpy().astype(numpy.float64)

    grads = [host(g) for g in got[2:] if g is not None]
    return _check.compare(case, inputs, host(got[0]), host(got[1]), grads), got


def cupyflash_attention(q, k, v):
    return cft.flash_attn_func(q, k, v, causal=True)
