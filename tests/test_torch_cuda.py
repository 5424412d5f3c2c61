"""cupyflash.torch on CUDA tensors only (marked `gpu`): the options and varlen under the project's rule
(cupyflash/_check.py), dropout's seed and the deterministic backward, packed varlen views, the
caller's stream and torch's allocator.
(The test_torch_*.py files are split by concern; test_torch_autograd.py lists them.)
"""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("torch_helpers")

import cupyflash.torch as cft  # noqa: E402
from cupyflash._check import Case  # noqa: E402
import option_cases  # noqa: E402
from torch_helpers import (RESULT_NAMES, _dropin, _inputs, _max_error, _run, _run_gpu_case,  # noqa: E402
                           _varlen_call, _varlen_inputs, cupyflash_attention, sdpa_reference)


GPU_OPTION_CASES = option_cases.GPU_CASES


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_OPTION_CASES, ids=str)
def test_gpu_options_match_reference(case):
    result, _ = _run_gpu_case(case, seed=41)
    assert result.ok, f"{case}: {result.describe()}"


@pytest.mark.gpu
def test_gpu_dropout_follows_torch_manual_seed():
    # deterministic: dq is repeatable bit for bit only when its adds come in a fixed order
    case = Case(113, 200, 64, "bfloat16", True, nheads=4, nheads_k=2, dropout_p=0.2, deterministic=True)
    (_, first), (_, again), (_, other) = (_run_gpu_case(case, seed=42, torch_seed=s) for s in (1, 1, 2))
    for name, x, y, z in zip(RESULT_NAMES[:5], first, again, other):
        assert torch.equal(x, y), name  # the dropout mask and the deterministic parts are repeatable...
        assert torch.equal(x, z) if name == "lse" else not torch.equal(x, z), name  # ...and the seed matters


@pytest.mark.gpu
@pytest.mark.parametrize("case", option_cases.DETERMINISTIC_CASES, ids=str)
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


@pytest.mark.gpu
def test_gpu_varlen_reads_a_batchs_cu_seqlens_once(monkeypatch):
    """A training step's varlen calls (forward and backward, here two layers) read their cu_seqlens
    on the host once; a write through torch makes the next call read them again, and a bad value
    so written is an error."""
    from cupyflash import _arrays
    reads = []
    read = _arrays.to_host
    monkeypatch.setattr(_arrays, "to_host", lambda array, caller: reads.append(array) or read(array, caller))
    lengths = ((77, 3, 150), (60, 3, 200))
    q, k, v, dout, cu_q, cu_k = _varlen_inputs(lengths, 4, 2, 64, torch.bfloat16, "cuda", seed=45)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    for _ in range(2):
        out = cft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 150, 200, causal=True)
        out = cft.flash_attn_varlen_func(out, k, v, cu_q, cu_k, 150, 200, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)
    assert len(reads) == 2  # cu_seqlens_q and cu_seqlens_k, at the first call
    cu_k[1] += 100  # (0, 160, 63, 263)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be non-decreasing, got cu_seqlens_k\[1\] = 160"):
        cft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 150, 200, causal=True)
    assert len(reads) == 4


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


# The first fwd+bwd of a fresh process: its backward's plan is made on autograd's new thread.
_FIRST_BACKWARD = """
import torch
from cupyflash import _plan
from cupyflash.torch import flash_attn_func
q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
grads = torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), torch.randn_like(q))
assert all(torch.isfinite(g).all() for g in grads)
print(sorted({k.wgmma for plan in _plan._plans.values() for k in plan.kernels if k.pass_ == "bwd"}))
"""


@pytest.mark.gpu
def test_eager_backward_on_hopper_runs_the_wgmma_kernels():
    """The drop-in's eager backward makes its plan on autograd's backward thread, which has no CUDA
    context current at its first call (and the driver encodes no tensor map without one): on
    compute capability 9.0 it still runs the wgmma kernels, not the mma.sync fallback."""
    import os
    import subprocess
    import sys
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernels run on compute capability 9.0")
    env = {name: value for name, value in os.environ.items() if name not in ("CUPYFLASH_FAMILY", "CUPYFLASH_TILES")}
    run = subprocess.run([sys.executable, "-c", _FIRST_BACKWARD], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[True]", run.stdout
