"""cupyflash.torch, the torch.library custom ops themselves: opcheck (schema, fake implementations,
autograd registration, AOT dispatch) with the options off and on, dense and varlen; fake tensors'
shapes, dtypes and strides; gradcheck through the forward ops with every option; the eager path that
skips them gives what they give.
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


@pytest.mark.parametrize("device", DEVICES)
def test_eager_calls_skip_the_dispatcher_and_match_the_custom_ops(device, monkeypatch):
    """An eager drop-in call runs the ops' implementations under an autograd.Function, not the custom
    ops (whose layers cost host time), and gives the same out, lse and gradients, the bias's and a
    dropout mask drawn from the same torch seed included, dense and varlen."""
    import cupyflash.torch as cft
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    shape = (2, 17, 29, 4, 2, 16, True)
    q, k, v, dout = _inputs(shape, dtype, device, seed=7)
    bias = torch.randn(4, 17, 29, dtype=torch.float64).to(device, dtype)
    calls = {}
    for op in (cft._forward, cft._varlen_forward):
        monkeypatch.setattr(op, "op", _counting(op.op, calls, op))
    cu = torch.tensor([0, 9, 17], dtype=torch.int32, device=device), torch.tensor([0, 20, 29], dtype=torch.int32,
                                                                                   device=device)

    def run(dense):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, bias)]
        torch.manual_seed(3)
        if dense:
            out, lse, _ = cft.flash_attn_func(*leaves[:3], dropout_p=0.25, causal=True, softcap=2.0,
                                              deterministic=True, return_attn_probs=True, attn_bias=leaves[3])
        else:
            out, lse, _ = cft.flash_attn_varlen_func(*(x[0] for x in leaves[:3]), *cu, 9, 20, dropout_p=0.25,
                                                     causal=True, deterministic=True, return_attn_probs=True)
            leaves = leaves[:3]
        grads = torch.autograd.grad(out, leaves, dout if dense else dout[0])
        return [out, lse, *grads]

    for dense in (True, False):
        calls.clear()
        eager = run(dense)
        assert not calls  # the eager path does not go through the custom ops
        with monkeypatch.context() as forced:
            forced.setattr(cft, "_eager", lambda *tensors: False)
            through_ops = run(dense)
        assert sum(calls.values()) == 1
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv", "dbias"), eager, through_ops):
            assert torch.equal(x, y), name


def _counting(op, calls, key):
    def counted(*args, **kwargs):
        calls[key] = calls.get(key, 0) + 1
        return op(*args, **kwargs)
    return counted


@pytest.mark.gpu
def test_repeated_dense_calls_run_their_resolved_plans(monkeypatch):
    """A dense eager call on CUDA tensors is resolved once per signature (checks, op arguments, the
    core's plans) and its repeats run the plans on their own tensors: out, lse and gradients equal
    the ops' way bit for bit, with or without grad, dropout seeds drawn as there, a dout of another
    layout (an expanded one), the bias's gradient, and a misaligned view of q, which the plans
    cannot take, sent the ops' way."""
    import cupyflash.torch as cft
    shape = (2, 113, 77, 4, 2, 40, True)
    q, k, v, dout = _inputs(shape, torch.bfloat16, "cuda", seed=12)
    generator = torch.Generator().manual_seed(13)
    bias = torch.randn(4, 113, 77, generator=generator).to("cuda", torch.bfloat16)
    slopes = torch.rand(4, generator=generator).to("cuda")
    storage = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    misaligned = storage[1:].view(q.shape)  # contiguous, 2 bytes past a 16-byte boundary
    misaligned.copy_(q)
    cases = [(dict(causal=True), q, dout), (dict(causal=True), q, dout[:1].expand_as(dout)),
             (dict(dropout_p=0.2, softcap=3.0, alibi_slopes=slopes, deterministic=True, attn_bias=bias), q, dout),
             (dict(causal=True), misaligned, dout)]
    counts = {}
    monkeypatch.setattr(cft._Resolved, "forward", _counting(cft._Resolved.forward, counts, "forward"))

    def run(options, q, dout, grad):
        leaves = [x.detach().clone().requires_grad_(grad) for x in (q, k, v)]
        given = dict(options)
        if "attn_bias" in given:
            given["attn_bias"] = given["attn_bias"].detach().clone().requires_grad_(grad)
            leaves.append(given["attn_bias"])
        leaves[0] = leaves[0] if q is not misaligned else misaligned.detach().requires_grad_(grad)
        torch.manual_seed(5)
        out, lse, _ = cft.flash_attn_func(*leaves[:3], return_attn_probs=True, **given)
        grads = torch.autograd.grad(out, leaves, dout) if grad else []
        return [out, lse, *grads]

    for options, q_case, dout_case in cases:
        for grad in (False, True):
            resolved = [run(options, q_case, dout_case, grad) for _ in range(2)]  # made, then found
            with monkeypatch.context() as forced:
                forced.setattr(cft, "_resolution", lambda *args: None)
                through_ops = run(options, q_case, dout_case, grad)
            for again in resolved:
                for name, x, y in zip(("out", "lse", "dq", "dk", "dv", "dbias"), again, through_ops):
                    assert torch.equal(x, y), (list(options), grad, name)
    assert counts["forward"] == 2 * 2 * len(cases)  # every call but the forced ones took its resolved plans


def test_ops_bind_their_arguments_as_their_signatures_do():
    """The ops' quick binding of positional arguments (as the dispatcher passes them) gives what
    inspect's binding gives, every default filled in; anything else goes through inspect, which
    names what is wrong."""
    import cupyflash.torch as cft
    for op in (cft._forward, cft._backward, cft._varlen_forward, cft._varlen_backward):
        for given in range(op.required, len(op.names) + 1):
            args = [object() for _ in range(given)]
            bound = op.signature.bind(*args)
            bound.apply_defaults()
            assert op.bind(*args) == dict(bound.arguments)
        with pytest.raises(TypeError):
            op.bind(*range(op.required - 1))
        with pytest.raises(TypeError):
            op.bind(*range(len(op.names) + 1))


@pytest.mark.gpu
def test_ops_on_cuda_run_the_resolved_plans_with_the_cores_bits():
    """A dense op call on CUDA tensors runs its signature's resolved plans (what the drop-in's eager
    calls run), not the core's public functions: the same bits as the core's, forward and backward,
    with the options off and on (dropout's seed a CPU tensor; dbias asked and not)."""
    import cupyflash.torch as cft
    for shape in [(2, 17, 29, 4, 2, 16, True), (1, 113, 113, 2, 2, 64, False)]:
        q, k, v, dout = _inputs(shape, torch.bfloat16, "cuda", seed=8)
        plain = (0.25, shape[-1], -1, -1, 0.0, None, None, 0.0, None, True)
        every = tuple(x.detach() if isinstance(x, torch.Tensor) else x
                      for x in _option_args(shape, torch.bfloat16, "cuda", seed=8))
        for options in (plain, every):
            forward = cft._forward.bind(q, k, v, *options)
            resolved = cft._resolution(q, k, v, forward["alibi_slopes"], forward["attn_bias"],
                                       (0.25, shape[-1], forward["dropout_p"], options[2:4], forward["softcap"], True))
            assert resolved, "a dense CUDA call has resolved plans"
            out, lse = cft._forward.compute(forward)
            for got, want in zip((out, lse), cft._forward.core(forward)):
                assert torch.equal(got, want)
            for return_dbias in (False, True):
                backward = cft._backward.bind(dout, q, k, v, out, lse, *options, return_dbias)
                got, want = cft._backward.compute(backward), cft._backward.core(backward)
                for name, x, y in zip(("dq", "dk", "dv", "dbias"), got, want):
                    assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
                assert (got[3] is not None) == (return_dbias and forward["attn_bias"] is not None)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_op_asked_for_dbias_without_a_bias(device):
    """return_dbias=True with no attn_bias: the gradients, and dbias as the op's empty (0,) tensor
    (custom ops return no optional tensor), not an error."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, dout = _inputs((1, 17, 17, 2, 2, 16, True), dtype, device, seed=9)
    ops = torch.ops.cupyflash
    out, lse = ops.flash_attn_forward(q, k, v, 0.25, True)
    *grads, dbias = ops.flash_attn_backward(dout, q, k, v, out, lse, 0.25, True, deterministic=True,
                                            return_dbias=True)
    want = ops.flash_attn_backward(dout, q, k, v, out, lse, 0.25, True, deterministic=True)[:3]
    assert dbias.shape == (0,)
    for got, expected in zip(grads, want):
        assert torch.equal(got, expected)
