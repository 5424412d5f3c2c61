"""cupyflash.torch, autograd: out, lse and the gradients of flash_attn_func against PyTorch's SDPA (math
backend, float64) on the CPU and, marked `gpu`, on CUDA under cupyflash/_check.py's rule.

The PyTorch tests are split by concern, one file each: test_torch_ops (torch.library custom ops:
opcheck, fake tensors, gradcheck), test_torch_autograd, test_torch_options (the drop-in's options),
test_torch_varlen, test_torch_dropin (flash_attn's signatures, packed forms, argument checks),
test_torch_compile (torch.compile), test_torch_cuda (CUDA only: options, streams, allocator),
test_torch_kvcache (flash_attn_with_kvcache), test_torch_ring (ring attention over gloo) and
test_torch_model (Llama-style models trained end to end); their helpers are in torch_helpers.py.
On the CPU the ops run the NumPy float64 reference.
"""

import math

import numpy
import pytest

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("torch_helpers")

import cupyflash.torch as cft  # noqa: E402
from cupyflash import reference  # noqa: E402
from torch_helpers import (DEVICES, UNIT_ROUNDOFF, _ids, _inputs, _max_error, _run,  # noqa: E402
                           sdpa_reference)


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal)
SHAPES = [(2, 17, 17, 2, 2, 16, False),
          (2, 17, 17, 4, 2, 32, True),    # GQA, causal
          (1, 13, 40, 6, 2, 8, True),     # causal with seqlen_q < seqlen_k
          (2, 40, 13, 4, 1, 16, True),    # MQA, causal with rows that see no key
          (1, 1, 1, 1, 1, 8, True)]
GPU_SHAPES = SHAPES + [(2, 300, 300, 8, 2, 64, True), (1, 129, 257, 4, 4, 128, False)]


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
    rounded once to the dtype: within one unit in the last place of each element. The backward's
    inputs include the forward's out (in the dtype) and lse (float32), from which it takes its
    probabilities and row terms as the kernels do: its float64 result is that of those inputs."""
    shape = (2, 17, 23, 4, 2, 16, True)
    q, k, v, dout = _inputs(shape, dtype, "cpu", seed=2)
    got = _run(lambda q, k, v: cft.flash_attn_func(q, k, v, causal=True), q, k, v, dout)
    q64, k64, v64, dout64 = (x.double().numpy() for x in (q, k, v, dout))
    out, lse = reference.attention_forward(q64, k64, v64, causal=True)
    grads = reference.attention_backward(dout64, q64, k64, v64, causal=True, out=got[0].double().numpy(),
                                         lse=lse.astype(numpy.float32))
    ref = [torch.from_numpy(x) for x in (out, *grads)]
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
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and lse.shape == (1, 2, 20)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 32 ** -0.5
    scores = scores.masked_fill(torch.ones(20, 20, dtype=torch.bool, device=device).triu(1), -math.inf)
    assert _max_error(lse, scores.logsumexp(-1)) <= 1e-4  # float32 lse from float32 score sums
