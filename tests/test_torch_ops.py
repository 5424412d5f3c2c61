"""cupyflash.torch, the torch.library custom ops themselves: opcheck (schema, fake implementations,
autograd registration, AOT dispatch) with the options off and on, dense and varlen; fake tensors'
shapes, dtypes and strides; gradcheck through the forward ops with every option.
(The test_torch_*.py files are split by concern; test_torch_autograd.py lists them.)
"""

import pytest

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("torch_helpers")

from torch_helpers import (DEVICES, LENGTHS, _inputs, _option_args, _varlen_inputs)  # noqa: E402


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


def test_cpu_varlen_gradcheck():
    q, k, v, _, cu_q, cu_k = _varlen_inputs(((2, 0, 4), (3, 2, 3)), 2, 1, 8, torch.float64, "cpu", seed=35)
    alibi = torch.tensor([0.3, 0.1])

    def attention(q, k, v):
        return torch.ops.cupyflash.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 3, 0.5, True, 2, 0, 1.5, alibi,
                                                             0.3, torch.tensor(77), False)[0]

    assert torch.autograd.gradcheck(attention, [x.requires_grad_() for x in (q, k, v)])
