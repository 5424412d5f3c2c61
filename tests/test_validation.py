"""Bad input gets a clear exception naming the argument and what was received, before any launch.

NumPy arrays take the same validation as GPU arrays (and then run the reference), so these run on CPU.
"""

import numpy
import pytest

from cupyflash import flash_attn_backward, flash_attn_func


def _qkv(b=2, sq=17, sk=23, h=4, hk=2, d=64, dtype=numpy.float16, seed=0):
    rng = numpy.random.default_rng(seed)
    return (rng.standard_normal((b, sq, h, d)).astype(dtype), rng.standard_normal((b, sk, hk, d)).astype(dtype),
            rng.standard_normal((b, sk, hk, d)).astype(dtype))


@pytest.mark.parametrize("change, error, message", [
    (lambda q, k, v: (q[0], k, v), ValueError, r"q must be 4-D .* got shape \(17, 4, 64\)"),
    (lambda q, k, v: (q, k[None], v), ValueError, r"k must be 4-D .* got shape \(1, 2, 23, 2, 64\)"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"k has batch 1 but q has batch 2"),
    (lambda q, k, v: (q, k, v[:, :5]), ValueError, r"k and v must have the same shape, got k \(2, 23, 2, 64\) and v \(2, 5, 2, 64\)"),
    (lambda q, k, v: (q[..., :32], k, v), ValueError, r"k has head dim 64 but q has head dim 32"),
    (lambda q, k, v: (q[:, :, :3], k, v), ValueError, r"q's nheads \(3\) must be a multiple of k's nheads \(2\)"),
    (lambda q, k, v: (q[..., :36], k[..., :36], v[..., :36]), ValueError, r"multiple of 8 and at most 256, got 36"),
    (lambda q, k, v: (q[:, :0], k, v), ValueError, r"q has an empty dimension: shape \(2, 0, 4, 64\)"),
    (lambda q, k, v: (q, k[:, :0], v[:, :0]), ValueError, r"k has an empty dimension"),
    (lambda q, k, v: (q.astype(numpy.int32), k, v), TypeError, r"q must have dtype .* got int32"),
    (lambda q, k, v: (q, k.astype(numpy.float32), v), TypeError, r"k has dtype float32 but q has dtype float16"),
    (lambda q, k, v: (q.tolist(), k, v), TypeError, r"q must be a CuPy, PyTorch or JAX array .* got builtins.list"),
])
def test_bad_qkv(change, error, message):
    with pytest.raises(error, match=message):
        flash_attn_func(*change(*_qkv()))


def test_head_dim_over_256_is_refused():
    q, k, v = _qkv(d=264)
    with pytest.raises(ValueError, match=r"at most 256, got 264"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("scale, error", [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                          (float("inf"), ValueError), ("0.1", TypeError), (True, TypeError)])
def test_bad_softmax_scale(scale, error):
    with pytest.raises(error, match=r"softmax_scale must be"):
        flash_attn_func(*_qkv(), softmax_scale=scale)


def test_causal_must_be_a_bool():
    with pytest.raises(TypeError, match=r"causal must be a bool, got 'yes'"):
        flash_attn_func(*_qkv(), causal="yes")


def test_backward_checks_dout_out_and_lse():
    q, k, v = _qkv()
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"dout must have q's shape \(2, 17, 4, 64\), got \(2, 16, 4, 64\)"):
        flash_attn_backward(out[:, :16], q, k, v, out, lse)
    with pytest.raises(TypeError, match=r"out has dtype float32 but q has dtype float16"):
        flash_attn_backward(out, q, k, v, out.astype(numpy.float32), lse)
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, nheads, seqlen_q\) = \(2, 4, 17\), got \(2, 17, 4\)"):
        flash_attn_backward(out, q, k, v, out, lse.transpose(0, 2, 1))
    with pytest.raises(TypeError, match=r"lse must have dtype float32, got float64"):
        flash_attn_backward(out, q, k, v, out, lse.astype(numpy.float64))


def test_numpy_path_runs_the_reference_in_the_input_dtype():
    from cupyflash import reference
    q, k, v = _qkv(dtype=numpy.float32)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = reference.attention_forward(q, k, v, causal=True)
    assert out.dtype == numpy.float32 and lse.dtype == numpy.float32
    numpy.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    dq, dk, dv = flash_attn_backward(numpy.ones_like(out), q, k, v, out, lse, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


class _FakeDLPackArray:
    """Stands for another library's array: shape, dtype and a DLPack device, nothing else."""

    def __init__(self, shape, device_type=2, device_id=0, dtype="float16"):
        self.shape, self.dtype, self._device = shape, numpy.dtype(dtype), (device_type, device_id)

    def __dlpack__(self, stream=None):
        raise AssertionError("validation must refuse this input before importing it")

    def __dlpack_device__(self):
        return self._device


def test_arrays_on_different_gpus_are_refused():
    q = _FakeDLPackArray((1, 8, 2, 64), device_id=0)
    k = v = _FakeDLPackArray((1, 8, 2, 64), device_id=1)
    with pytest.raises(ValueError, match=r"k is on CUDA device 1 but q is on CUDA device 0"):
        flash_attn_func(q, k, v)


def test_cpu_dlpack_arrays_are_refused():
    q = k = v = _FakeDLPackArray((1, 8, 2, 64), device_type=1)
    with pytest.raises(ValueError, match=r"q is a dlpack array on the CPU"):
        flash_attn_func(q, k, v)


def test_mixed_kinds_are_refused():
    q = _FakeDLPackArray((1, 8, 2, 64))
    k = v = numpy.zeros((1, 8, 2, 64), numpy.float16)
    with pytest.raises(TypeError, match=r"k is a numpy array but q is a dlpack array"):
        flash_attn_func(q, k, v)
