"""cupyflash.torch under torch.compile: one graph without breaks (aot_eager and inductor), with the
options and varlen, giving eager's loss and gradients; dropout's seed under inductor.
(The test_torch_*.py files are split by concern; test_torch_autograd.py lists them.)
"""

import pytest

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("torch_helpers")

import cupyflash.torch as cft  # noqa: E402
from torch_helpers import LENGTHS, _inputs, _option_args, _varlen_inputs  # noqa: E402


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
