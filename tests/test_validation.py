"""Bad input gets a clear exception naming the argument and what was received, before any launch.

NumPy arrays take the same validation as GPU arrays (and then run the reference), so these run on CPU.
"""

import numpy
import pytest

from cupyflash import flash_attn_backward, flash_attn_func, flash_attn_varlen_func


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


# The options and varlen arguments (NumPy path: the same checks as on the GPU).

@pytest.mark.parametrize("options, error, message", [
    (dict(window_size=(-2, 0)), ValueError, r"window_size entries must be >= -1 .* got \(-2, 0\)"),
    (dict(window_size=(3, -5)), ValueError, r"window_size entries must be >= -1"),
    (dict(window_size=5), ValueError, r"window_size must be a pair"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite number >= 0 .* got -1.0"),
    (dict(softcap=float("inf")), ValueError, r"softcap must be"),
    (dict(softcap="big"), TypeError, r"softcap must be a finite number >= 0 .* got 'big'"),
    (dict(softcap=True), TypeError, r"softcap must be a finite number >= 0 .* got True"),
    (dict(dropout_p=None, seed=1), TypeError, r"dropout_p must be a real number in \[0, 1\), got None"),
    (dict(alibi_slopes=numpy.ones(3, numpy.float32)), ValueError, r"alibi_slopes must have shape \(nheads,\) = \(4,\) "
                                                                   r"or \(batch, nheads\) = \(2, 4\), got \(3,\)"),
    (dict(alibi_slopes=numpy.ones(4, numpy.float64)), TypeError, r"alibi_slopes must have dtype float32, got float64"),
    (dict(dropout_p=1.0, seed=1), ValueError, r"dropout_p must be a real number in \[0, 1\), got 1.0"),
    (dict(dropout_p=-0.1, seed=1), ValueError, r"dropout_p must be"),
    (dict(dropout_p=0.1), ValueError, r"seed is required when dropout_p > 0"),
    (dict(dropout_p=0.1, seed=-3), ValueError, r"seed must be .* got -3"),
    (dict(dropout_p=0.1, seed=numpy.zeros(2, numpy.int32)), TypeError,
     r"seed must be an integer in \[0, 2\*\*64\) or a uint32 array of shape \(2,\) .* got an array of dtype int32 and shape \(2,\)"),
    (dict(dropout_p=0.1, seed=numpy.zeros(3, numpy.uint32)), TypeError, r"seed must be .* got an array of dtype uint32 and shape \(3,\)"),
    (dict(attn_bias=numpy.ones((2, 4, 17, 22), numpy.float32)), ValueError,
     r"attn_bias must broadcast from .* = \(2, 4, 17, 23\), got shape \(2, 4, 17, 22\)"),
    (dict(attn_bias=numpy.ones((3, 1, 17, 23), numpy.float32)), ValueError, r"attn_bias must broadcast"),
    (dict(attn_bias=numpy.ones((23,), numpy.float32)), ValueError, r"attn_bias must broadcast"),
    (dict(attn_bias=numpy.ones((17, 23), numpy.int32)), TypeError, r"attn_bias must have dtype"),
])
def test_bad_options(options, error, message):
    with pytest.raises(error, match=message):
        flash_attn_func(*_qkv(), **options)


def test_alibi_refuses_sequences_past_its_exact_distances():
    q = k = v = numpy.ones((8, 2, 64), numpy.float16)
    cu_seqlens = numpy.array([0, 8], numpy.int32)
    slopes = numpy.ones(2, numpy.float32)
    with pytest.raises(ValueError, match=r"alibi_slopes takes seqlen_q \+ seqlen_k up to 2\*\*23 = 8388608 .* "
                                         r"got 8388600 \+ 9"):
        flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, 8388600, 9, alibi_slopes=slopes)
    flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, 8388599, 9, alibi_slopes=slopes)  # at the limit


def test_a_seed_array_holds_the_seeds_eight_bytes():
    q, k, v = _qkv()
    seed = 0x0123456789ABCDEF
    want = flash_attn_func(q, k, v, dropout_p=0.3, seed=seed)
    for array in (numpy.array([seed & 0xFFFFFFFF, seed >> 32], numpy.uint32), numpy.array([seed], numpy.int64),
                  numpy.array(seed, numpy.uint64)):
        numpy.testing.assert_array_equal(flash_attn_func(q, k, v, dropout_p=0.3, seed=array), want)
    assert not numpy.array_equal(flash_attn_func(q, k, v, dropout_p=0.3, seed=seed + 1), want)


def test_a_numpy_integer_seed_is_an_integer():
    q, k, v = _qkv()
    want = flash_attn_func(q, k, v, dropout_p=0.3, seed=7)
    for seed in (numpy.uint32(7), numpy.int64(7), numpy.uint64(7)):
        numpy.testing.assert_array_equal(flash_attn_func(q, k, v, dropout_p=0.3, seed=seed), want)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\), got .*-1"):
        flash_attn_func(q, k, v, dropout_p=0.3, seed=numpy.int64(-1))


def test_backward_checks_deterministic_and_return_dbias():
    q, k, v = _qkv()
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match=r"deterministic must be a bool, got 'yes'"):
        flash_attn_backward(out, q, k, v, out, lse, deterministic="yes")
    with pytest.raises(TypeError, match=r"return_dbias must be a bool"):
        flash_attn_backward(out, q, k, v, out, lse, return_dbias=1)


def _packed(total_q=30, total_k=40):
    rng = numpy.random.default_rng(1)
    return (rng.standard_normal((total_q, 4, 64)).astype(numpy.float16),
            rng.standard_normal((total_k, 2, 64)).astype(numpy.float16),
            rng.standard_normal((total_k, 2, 64)).astype(numpy.float16))


@pytest.mark.parametrize("cu_q, cu_k, max_q, max_k, error, message", [
    ([0, 10, 30], [0, 25, 40], 20, 25, None, None),
    (numpy.array([0, 10, 30], numpy.int64), [0, 25, 40], 20, 25, TypeError, r"cu_seqlens_q .*int32"),
    ([0, 20, 10, 30], [0, 5, 25, 40], 20, 25, ValueError, r"cu_seqlens_q"),              # decreasing
    ([0, 10, 31], [0, 25, 40], 21, 25, ValueError, r"cu_seqlens_q"),                     # past the total
    ([0, 10, 30], [0, 25, 39], 20, 25, ValueError, r"cu_seqlens_k"),                     # short of the total
    ([1, 10, 30], [0, 25, 40], 20, 25, ValueError, r"cu_seqlens_q"),                     # not from 0
    ([0, 10, 30], [0, 40], 20, 40, ValueError, r"same length"),
    ([0, 10, 30], [0, 25, 40], 19, 25, ValueError, r"max_seqlen_q"),
    ([0, 10, 30], [0, 25, 40], 20, 24, ValueError, r"max_seqlen_k"),
    ([0, 10, 30], [0, 25, 40], 20.0, 25, ValueError, r"max_seqlen_q"),
])
def test_varlen_arguments(cu_q, cu_k, max_q, max_k, error, message):
    from cupyflash import flash_attn_varlen_func
    q, k, v = _packed()
    cu_q, cu_k = (numpy.asarray(c, numpy.int32) if isinstance(c, list) else c for c in (cu_q, cu_k))
    if error is None:
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
        assert out.shape == q.shape and numpy.isfinite(out.astype(numpy.float32)).all()
    else:
        with pytest.raises(error, match=message):
            flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)


def test_varlen_layout_errors():
    from cupyflash import flash_attn_varlen_func
    q, k, v = _packed()
    cu_q, cu_k = numpy.asarray([0, 10, 30], numpy.int32), numpy.asarray([0, 25, 40], numpy.int32)
    with pytest.raises(ValueError, match=r"q must be 3-D \(total, nheads, headdim\)"):
        flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, 20, 25)
    with pytest.raises(ValueError, match=r"lse must have shape \(nheads, total_q\) = \(4, 30\)"):
        from cupyflash import flash_attn_varlen_backward
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 25)
        flash_attn_varlen_backward(out, q, k, v, out, numpy.zeros((2, 4, 15), numpy.float32), cu_q, cu_k, 20, 25)


def test_a_torch_packing_is_read_again_only_after_torch_writes_it(monkeypatch):
    """A GPU varlen call's cu_seqlens (torch) are read on the host once, then again only where torch
    has written either tensor since or the call's totals or maxima differ: a bad value written in
    place is still an error. (The caller here is a stand-in: the tensors are on the CPU.)"""
    import types
    torch = pytest.importorskip("torch")
    from cupyflash import _arrays, validate
    reads = []
    read = _arrays.to_host
    monkeypatch.setattr(_arrays, "to_host", lambda array, caller: reads.append(array) or read(array, caller))
    caller = types.SimpleNamespace(kind="torch", capturing=lambda: False)
    cu_q, cu_k = torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([0, 25, 40], dtype=torch.int32)
    arrays = {"q": numpy.empty((30, 4, 8)), "k": numpy.empty((40, 2, 8))}
    varlen = validate.Varlen(cu_q, cu_k, 20, 25)
    validate.check_varlen_values(varlen, arrays, caller)
    validate.check_varlen_values(varlen, arrays, caller)
    assert len(reads) == 2
    validate.check_varlen_values(validate.Varlen(cu_q, cu_k, 20, 30), arrays, caller)  # another maximum
    validate.check_varlen_values(validate.Varlen(cu_q, cu_k.clone(), 20, 25), arrays, caller)  # another tensor
    assert len(reads) == 6
    cu_k[1] = 35  # 35 keys in the second sequence, above max_seqlen_k
    with pytest.raises(ValueError, match=r"max_seqlen_k must be >= the longest sequence \(35\), got 25"):
        validate.check_varlen_values(varlen, arrays, caller)
    with validate.no_host_sync():  # (nothing read)
        validate.check_varlen_values(varlen, arrays, caller)
    assert len(reads) == 8
    with torch.inference_mode():  # (inference tensors have no version counter: read every call)
        inference_q = cu_q.clone()
    cu_k[1] = 25
    for _ in range(2):
        validate.check_varlen_values(validate.Varlen(inference_q, cu_k, 20, 25), arrays, caller)
    assert len(reads) == 12
    cupy_caller = types.SimpleNamespace(kind="cupy", capturing=lambda: False)  # no version counter: every call
    good = validate.Varlen(numpy.asarray(cu_q), numpy.asarray([0, 25, 40], numpy.int32), 20, 25)
    monkeypatch.setattr(_arrays, "to_host", lambda array, caller: reads.append(array) or array)
    for _ in range(2):
        validate.check_varlen_values(good, arrays, cupy_caller)
    assert len(reads) == 16
    key = id(cu_q)
    del varlen, good, cu_q
    reads.clear()
    assert key not in validate._passed_packings  # (a tensor's entry leaves with it)


def test_check_command_numpy_path():
    """`python -m cupyflash check` without a GPU: the public NumPy path, plain and with every option,
    equals the tiled reference."""
    from cupyflash import __main__
    assert __main__._check_numpy() == 0


def test_a_bad_forced_tile_table_is_an_error_on_the_numpy_path_too(monkeypatch):
    monkeypatch.setenv("CUPYFLASH_TILES", "bogus")
    with pytest.raises(ValueError, match=r"CUPYFLASH_TILES must be one of .* got 'bogus'"):
        flash_attn_func(*_qkv())
