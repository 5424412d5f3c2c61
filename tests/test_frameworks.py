"""PyTorch and JAX arrays through DLPack: zero copy in, the caller's kind out, the caller's stream."""

import os

import numpy
import pytest

from cupyflash import _check
from cupyflash._check import Case

pytestmark = pytest.mark.gpu
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy and torch


def _poison_torch_cache(torch):
    """Fill torch's cached blocks with NaN so outputs the kernels fail to write show up."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


@pytest.mark.parametrize("case", [Case(113, 300, 128, "bfloat16", True, nheads=4, nheads_k=2),
                                  Case(300, 300, 72, "float16", False),
                                  Case(129, 129, 64, "bfloat16", True, layout="qkvpacked")], ids=str)
def test_torch(case):
    torch = pytest.importorskip("torch")
    _poison_torch_cache(torch)
    result = _check.run_gpu_case(case, 3, wrap=torch.from_dlpack, unwrap=lambda t: t.float().cpu().numpy())
    assert result.ok, result.describe()


def test_torch_results_are_torch_tensors_on_the_same_device():
    torch = pytest.importorskip("torch")
    from cupyflash import flash_attn_backward, flash_attn_func
    q, k, v = (torch.randn(1, 40, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.device == q.device and out.dtype == q.dtype
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == (1, 2, 40)
    grads = flash_attn_backward(torch.randn_like(out), q, k, v, out, lse)
    assert all(isinstance(g, torch.Tensor) and g.shape == x.shape for g, x in zip(grads, (q, k, v)))


def test_torch_side_stream_ordering():
    """Inputs written on a side stream after a long sleep: a launch on any other stream reads them early."""
    torch = pytest.importorskip("torch")
    from cupyflash import flash_attn_func
    from cupyflash import reference
    rng = numpy.random.default_rng(5)
    host = [reference.round_to(rng.standard_normal((2, 256, 4, 64)), "bfloat16") for _ in range(3)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q, k, v = (torch.empty(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles on the side stream
        for dst, src in zip((q, k, v), host):
            dst.copy_(torch.from_numpy(src).to(torch.bfloat16), non_blocking=True)
        out = flash_attn_func(q, k, v, causal=True)
    side.synchronize()
    ref, _ = reference.attention_forward(*host, causal=True)
    lowp = reference.attention_forward_lowp(*host, "bfloat16", causal=True)
    error = numpy.abs(out.float().cpu().numpy() - ref).max()
    assert error <= 2 * numpy.abs(lowp - ref).max() + 2 ** -7 * numpy.abs(ref).max()


def test_jax():
    jax = pytest.importorskip("jax")
    case = Case(113, 200, 64, "bfloat16", True, nheads=4, nheads_k=1)
    result = _check.run_gpu_case(case, 9, wrap=jax.dlpack.from_dlpack,
                                 unwrap=lambda x: numpy.asarray(x.astype("float32")))
    assert result.ok, result.describe()


def test_jax_results_are_jax_arrays():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from cupyflash import flash_attn_func
    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (1, 50, 2, 32), dtype=jnp.float16) for i in range(3))
    out = flash_attn_func(q, k, v)
    assert isinstance(out, jax.Array) and out.dtype == jnp.float16 and out.shape == q.shape
    assert bool(jnp.all(jnp.isfinite(out)))


def test_cpu_torch_tensor_mixed_with_gpu_tensors_is_refused():
    torch = pytest.importorskip("torch")
    from cupyflash import flash_attn_func
    q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    k = v = torch.randn(1, 8, 2, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="q is a torch array on the CPU"):
        flash_attn_func(q, k, v)


def test_last_dim_not_contiguous_is_refused():
    torch = pytest.importorskip("torch")
    from cupyflash import flash_attn_func
    q = torch.randn(1, 8, 64, 2, dtype=torch.float16, device="cuda").transpose(-1, -2)
    k = v = torch.randn(1, 8, 2, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        flash_attn_func(q, k, v)
