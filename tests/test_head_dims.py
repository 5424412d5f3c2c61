"""Every head dim from 1 to 256, as flash_attn takes them: the kernels run at multiples of 8, so
other head dims are zero-padded inside the call (the scale stays the caller's head dim's) and the
results cut back; the NumPy path takes them as they are."""

import numpy
import pytest

from cupyflash import _check, flash_attn_backward, flash_attn_func, flash_attn_varlen_func, reference
from cupyflash._check import Case

ODD = [1, 3, 59, 111, 250]


@pytest.mark.parametrize("headdim", ODD)
def test_numpy_path_takes_every_head_dim(headdim):
    rng = numpy.random.default_rng(headdim)
    q, k, v, dout = (rng.standard_normal(shape) for shape in [(2, 17, 4, headdim), (2, 23, 2, headdim),
                                                               (2, 23, 2, headdim), (2, 17, 4, headdim)])
    out, lse = flash_attn_func(q, k, v, causal=True, softcap=2.0, return_lse=True)
    dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, causal=True, softcap=2.0, deterministic=True)
    tiled_out, tiled_lse = reference.attention_forward_tiled(q, k, v, causal=True, softcap=2.0, block_m=16,
                                                             block_n=16)
    tiled = reference.attention_backward_tiled(dout, q, k, v, tiled_out, tiled_lse, causal=True, softcap=2.0,
                                               block_m=16, block_n=16)
    assert out.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for got, want in zip((out, lse, dq, dk, dv), (tiled_out, tiled_lse, *tiled)):
        numpy.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    # The default scale is the caller's head dim's.
    numpy.testing.assert_allclose(out, flash_attn_func(q, k, v, headdim ** -0.5, causal=True, softcap=2.0),
                                  rtol=0, atol=0)


def test_float64_lse_stays_float64_and_is_taken_back():
    rng = numpy.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 9, 2, 16)) for _ in range(3))
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert lse.dtype == numpy.float64
    _, ref_lse = reference.attention_forward(q, k, v)
    numpy.testing.assert_array_equal(lse, ref_lse)  # no digit lost on the way out
    flash_attn_backward(out, q, k, v, out, lse)
    with pytest.raises(TypeError, match=r"lse must have dtype float64, got float32"):
        flash_attn_backward(out, q, k, v, out, lse.astype(numpy.float32))


GPU_CASES = [Case(113, 200, d, dtype, causal, nheads=4, nheads_k=hk)
             for d, dtype, causal, hk in [(1, "float16", False, 4), (3, "bfloat16", True, 2), (59, "bfloat16", True, 1),
                                          (111, "float16", False, 2), (250, "bfloat16", True, 4)]]
GPU_CASES += [Case(200, 113, 59, "bfloat16", True, nheads=4, nheads_k=2, window_size=(37, 11), softcap=1.5),
              Case(113, 113, 111, "float16", False, alibi_slopes=True, attn_bias="heads", deterministic=True),
              Case(113, 113, 59, "bfloat16", True, dropout_p=0.17),
              Case.packed((0, 17, 113), (5, 40, 113), 59, "bfloat16", True, nheads=4, nheads_k=2),
              Case.packed((17, 113), (40, 113), 111, "float16", False, nheads=2, nheads_k=2, softcap=2.0)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_takes_every_head_dim(case, poisoned_allocations):
    result = _check.run_gpu_case(case, seed=len(str(case)))
    assert result.ok, result.describe()


@pytest.mark.gpu
def test_torch_dropin_at_odd_head_dims():
    """flash_attn-style calls at head dims 59 and 111 (plain, causal, GQA, softcap, window, varlen,
    deterministic): gradients of the caller's width, values as the reference's."""
    torch = pytest.importorskip("torch")
    import cupyflash.torch as cft
    for headdim in (59, 111):
        gen = torch.Generator().manual_seed(headdim)
        q = torch.randn(2, 70, 4, headdim, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
        k, v = (torch.randn(2, 90, 2, headdim, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
                for _ in range(2))
        for kwargs in (dict(), dict(causal=True), dict(softcap=5.0, window_size=(20, 3)), dict(deterministic=True)):
            out = cft.flash_attn_func(q, k, v, **kwargs)
            dq, dk, dv = torch.autograd.grad(out.float().square().sum(), (q, k, v))
            assert out.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape
            opts = {n: kwargs[n] for n in ("softcap", "window_size") if n in kwargs}
            host = [x.detach().float().cpu().numpy() for x in (q, k, v)]
            ref, _ = reference.attention_forward(*host, causal=kwargs.get("causal", False), **opts)
            lowp = reference.attention_forward_lowp(*host, "bfloat16", causal=kwargs.get("causal", False), **opts)
            # The 2x rule of cupyflash/_check.py: twice the naive bf16 error, plus an ulp at the output's scale.
            bound = 2 * numpy.abs(lowp - ref).max() + 2.0 ** -7 * (numpy.abs(ref).max() + 2.0 ** -6)
            assert numpy.abs(out.detach().float().cpu().numpy() - ref).max() <= bound
            assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
        cu = torch.tensor([0, 30, 70], dtype=torch.int32, device="cuda")
        packed = cft.flash_attn_varlen_func(q[0], k[0, :70], v[0, :70], cu, cu, 40, 40, causal=True)
        assert packed.shape == q[0].shape and torch.isfinite(packed).all()


@pytest.mark.gpu
def test_odd_head_dims_through_cupy_varlen_match_dense():
    import cupy
    rng = numpy.random.default_rng(1)
    import ml_dtypes
    q, k, v = (cupy.asarray(rng.standard_normal((37, 2, 59)).astype(ml_dtypes.bfloat16)) for _ in range(3))
    cu = cupy.asarray(numpy.array([0, 37], numpy.int32))
    packed = flash_attn_varlen_func(q, k, v, cu, cu, 37, 37, causal=True)
    dense = flash_attn_func(q[None], k[None], v[None], causal=True)[0]
    assert cupy.array_equal(packed.view(cupy.uint16), dense.view(cupy.uint16))
