"""CUDA graphs (marked `gpu`): forward+backward and varlen forward calls captured once, from CuPy
(stream capture) and from PyTorch (torch.cuda.graph), and replayed 100 times with new values
copied into the captured inputs, new dropout seeds and new cu_seqlens. A replay must equal the
same call made eagerly: bit for bit for the forward and the deterministic backward; the default
backward adds dq by atomics in no fixed order, so it meets the project's 3x rule against float64
instead (every tenth replay: the float64 reference runs on the host).
"""

import numpy
import pytest

from cupyflash import _check
from cupyflash._check import Case

REPLAYS = 100
CASE = dict(seqlen_q=113, seqlen_k=200, headdim=64, dtype="bfloat16", causal=True, batch=2, nheads=4, nheads_k=2)


def _seed_words(seed):
    return numpy.array([seed & 0xFFFFFFFF, seed >> 32], numpy.uint32)


def _replays(case):
    """(replay index, inputs) of every replay: fresh random q, k, v, dout and seed."""
    for i in range(REPLAYS):
        yield i, _check.random_inputs(case, 1000 + i)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_cupy_graph_replays_forward_and_backward(deterministic):
    cupy = pytest.importorskip("cupy")
    import cupyflash
    case = Case(**CASE, dropout_p=0.17, deterministic=deterministic)
    names = ("q", "k", "v", "dout")
    static = {n: a.copy() for n, a in _check.to_cupy_inputs(case, _check.random_inputs(case, 0)).items() if n in names}
    seed = cupy.zeros(2, cupy.uint32)

    def step(arrays, seed):
        q, k, v, dout = (arrays[n] for n in names)
        out, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True, dropout_p=0.17, seed=seed)
        grads = cupyflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, dropout_p=0.17, seed=seed,
                                              deterministic=deterministic)
        return out, lse, grads

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step(static, seed)  # plans and kernels are made outside the capture
        stream.synchronize()
        stream.begin_capture()
        captured = step(static, seed)
        graph = stream.end_capture()
        for i, inputs in _replays(case):
            fresh = _check.to_cupy_inputs(case, inputs)
            for n in names:
                static[n][...] = fresh[n]
            seed.set(_seed_words(inputs["seed"]))
            graph.launch(stream)
            eager = step(fresh, inputs["seed"])
            stream.synchronize()
            out, lse, grads = captured
            assert bool((out == eager[0]).all()) and bool((lse == eager[1]).all()), f"replay {i}: forward"
            if deterministic:
                for name, x, y in zip(("dq", "dk", "dv"), grads, eager[2]):
                    assert bool((x == y).all()), f"replay {i}: {name}"
            elif i % 10 == 0:
                host = [numpy.asarray(cupy.asnumpy(g), numpy.float64) for g in grads]
                result = _check.compare(case, inputs, cupy.asnumpy(out).astype(numpy.float64),
                                        cupy.asnumpy(lse).astype(numpy.float64), host)
                assert result.ok, f"replay {i}: {result.describe()}"


@pytest.mark.gpu
def test_cupy_graph_replays_varlen_forward_with_new_cu_seqlens():
    cupy = pytest.importorskip("cupy")
    import cupyflash
    rng = numpy.random.default_rng(7)
    total, longest = 300, 200
    q, k, v = (cupy.asarray(rng.standard_normal((total, 4, 64)).astype(numpy.float16)) for _ in range(3))
    cupy.cuda.Device().synchronize()  # the copies above ran on the null stream, which `stream` does not wait for
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cu = cupy.asarray(_splits(0, total))  # on the stream that reads it (a non-blocking one)
        cupyflash.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)
        stream.synchronize()
        stream.begin_capture()
        out, lse = cupyflash.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True, return_lse=True)
        graph = stream.end_capture()
        for i in range(REPLAYS):
            host = _splits(i, total)
            cu.set(host)
            q[...] = cupy.asarray(rng.standard_normal((total, 4, 64)).astype(numpy.float16))
            graph.launch(stream)
            want_out, want_lse = cupyflash.flash_attn_varlen_func(q, k, v, cupy.asarray(host), cupy.asarray(host),
                                                                  longest, longest, causal=True, return_lse=True)
            stream.synchronize()
            assert bool((out == want_out).all()) and bool((lse == want_lse).all()), f"replay {i}: {host}"


def _splits(i, total):
    """cu_seqlens of three sequences of at most 200 rows that change with i."""
    first = 100 + i % 100
    return numpy.array([0, first, first + (total - first) // 2, total], numpy.int32)


def _torch_capture(torch, step, warmups=3):
    """(graph, the captured call's results) of step(), warmed up on a side stream as torch asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()
    return graph, results


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_graph_replays_dropin_forward_and_backward(deterministic):
    torch = pytest.importorskip("torch")
    import cupyflash.torch as cft
    case = Case(**CASE, deterministic=deterministic)
    names = ("q", "k", "v", "dout")
    to_torch = lambda inputs: {n: torch.as_tensor(a, device="cuda").to(torch.bfloat16)  # noqa: E731
                               for n, a in inputs.items() if n in names}
    static = to_torch(_check.random_inputs(case, 0))
    leaves = [static[n].requires_grad_() for n in ("q", "k", "v")]

    def step(q, k, v, dout):
        out = cft.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    graph, captured = _torch_capture(torch, lambda: step(*leaves, static["dout"]))
    for i, inputs in _replays(case):
        fresh = to_torch(inputs)
        with torch.no_grad():
            for n in names:
                static[n].copy_(fresh[n])
        graph.replay()
        eager = step(*(fresh[n].requires_grad_() for n in ("q", "k", "v")), fresh["dout"])
        torch.cuda.synchronize()
        assert torch.equal(captured[0], eager[0]), f"replay {i}: out"
        if deterministic:
            for name, x, y in zip(("dq", "dk", "dv"), captured[1:], eager[1:]):
                assert torch.equal(x, y), f"replay {i}: {name}"
        elif i % 10 == 0:
            (_, _, ref_grads), (_, _, lowp_grads) = _check._references(case, inputs, True)
            for name, got, want, lowp in zip(("dq", "dk", "dv"), captured[1:], ref_grads, lowp_grads):
                bound = 3 * _check._max_error(lowp, want) + _check._floor(case.dtype, want)
                assert _check._max_error(got.double().cpu().numpy(), want) <= bound, f"replay {i}: {name}"


@pytest.mark.gpu
def test_torch_graph_draws_a_new_dropout_seed_per_replay():
    """The drop-in draws its dropout seed on the device while a graph is captured: every replay
    drops other elements."""
    torch = pytest.importorskip("torch")
    import cupyflash
    import cupyflash.torch as cft
    case = Case(**CASE)
    inputs = _check.random_inputs(case, 3)
    q, k, v, dout = (torch.as_tensor(inputs[n], device="cuda").to(torch.bfloat16) for n in ("q", "k", "v", "dout"))
    q.requires_grad_()

    def step():
        out = cft.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
        return out, torch.autograd.grad(out, (q,), dout)[0]

    graph, (out, dq) = _torch_capture(torch, step)
    outs, dqs = [], []
    for _ in range(5):
        graph.replay()
        outs.append(out.clone())
        dqs.append(dq.clone())
    torch.cuda.synchronize()
    for seen in (outs, dqs):
        assert all(not torch.equal(seen[i], seen[j]) for i in range(5) for j in range(i + 1, 5))
        assert all(torch.isfinite(x).all() for x in seen)
    plain = cupyflash.flash_attn_func(q.detach(), k, v, causal=True)
    assert not torch.equal(outs[-1], plain)


@pytest.mark.gpu
def test_torch_graph_replays_core_with_a_seed_tensor():
    """The core API on torch tensors, captured with the dropout seed in a device tensor: each replay
    takes the seed copied into it and equals the eager call with that seed as an int."""
    torch = pytest.importorskip("torch")
    import cupyflash
    case = Case(**CASE, dropout_p=0.2, deterministic=True)
    static = {n: torch.as_tensor(a, device="cuda").to(torch.bfloat16)
              for n, a in _check.random_inputs(case, 0).items() if n in ("q", "k", "v", "dout")}
    seed = torch.zeros(2, dtype=torch.int32, device="cuda").view(torch.uint32) if hasattr(torch, "uint32") else None
    if seed is None:
        pytest.skip("this torch has no uint32")

    def step(seed):
        q, k, v, dout = (static[n] for n in ("q", "k", "v", "dout"))
        out, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True, dropout_p=0.2, seed=seed)
        return (out, lse, *cupyflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, dropout_p=0.2,
                                                         seed=seed, deterministic=True))

    graph, captured = _torch_capture(torch, lambda: step(seed))
    for i in range(REPLAYS):
        value = int(numpy.random.default_rng(i).integers(0, 2 ** 63))
        seed.copy_(torch.from_numpy(_seed_words(value).view(numpy.int32)).view(torch.uint32))
        graph.replay()
        eager = step(value)
        torch.cuda.synchronize()
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), captured, eager):
            assert torch.equal(x, y), f"replay {i}: {name}"


@pytest.mark.gpu
def test_torch_graph_replays_varlen_forward_with_new_cu_seqlens():
    torch = pytest.importorskip("torch")
    import cupyflash.torch as cft
    total, longest = 300, 200
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 100, 200, 300], dtype=torch.int32, device="cuda")
    graph, out = _torch_capture(torch, lambda: cft.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                                                          causal=True))
    for i in range(REPLAYS):
        host = torch.from_numpy(_splits(i, total))
        cu.copy_(host)
        q.copy_(torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen))
        graph.replay()
        want = cft.flash_attn_varlen_func(q, k, v, host.cuda(), host.cuda(), longest, longest, causal=True)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {i}: {host.tolist()}"


@pytest.mark.gpu
def test_unchecked_cu_seqlens_stay_inside_the_buffers():
    """Under no_host_sync, cu_seqlens that the host check would refuse (decreasing, past the packed
    length, longer than max_seqlen) run without an error: the kernels clamp every sequence into the
    packed arrays (tests/sanitize_run.py's memcheck would see an access outside them)."""
    cupy = pytest.importorskip("cupy")
    import cupyflash
    rng = numpy.random.default_rng(11)
    q, k, v = (cupy.asarray(rng.standard_normal((50, 4, 64)).astype(numpy.float16)) for _ in range(3))
    bad = cupy.asarray(numpy.array([0, 40, 10, 99999], numpy.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        cupyflash.flash_attn_varlen_func(q, k, v, bad, bad, 30, 30)
    with cupyflash.no_host_sync():
        out, lse = cupyflash.flash_attn_varlen_func(q, k, v, bad, bad, 30, 30, return_lse=True)
        grads = cupyflash.flash_attn_varlen_backward(out, q, k, v, out, lse, bad, bad, 30, 30)
    cupy.cuda.Device().synchronize()
    assert out.shape == q.shape and all(g.shape == q.shape for g in grads)


@pytest.mark.gpu
def test_a_calls_scratch_is_alive_when_its_kernels_launch(monkeypatch):
    """The workspaces a call allocates (a deterministic backward's zeroed semaphores) are still
    referenced when its kernels launch: dropped before, an allocator without a pool frees memory
    that the kernels then read (compute-sanitizer's memcheck caught it)."""
    pytest.importorskip("cupy")
    import weakref
    import cupyflash
    from cupyflash import api
    case = Case(**CASE, deterministic=True)
    arrays = _check.to_cupy_inputs(case, _check.random_inputs(case, 4))
    q, k, v, dout = (arrays[n] for n in ("q", "k", "v", "dout"))
    out, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    plan = api.plan_of("bwd", dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse), None, True,
                       dict(deterministic=True), "test")
    assert any(w.zeroed and not w.keepable for w in plan.workspaces)  # allocated by every call
    allocated, alive_at_launch = [], []

    def tracked(allocate):
        def allocate_and_track(inputs):
            array = allocate(inputs)
            allocated.append(weakref.ref(array))
            return array
        return allocate_and_track

    monkeypatch.setattr(plan, "workspaces", [w._replace(allocate=tracked(w.allocate)) for w in plan.workspaces])
    launch = plan.launch_kernel

    def launch_and_check(*args):
        alive_at_launch.append(bool(allocated) and all(ref() is not None for ref in allocated))
        return launch(*args)

    monkeypatch.setattr(plan, "launch_kernel", launch_and_check)
    cupyflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    assert alive_at_launch and all(alive_at_launch)


@pytest.mark.gpu
def test_cupy_plans_keep_scratch_per_stream_and_a_dropped_lse_apart():
    """A backward keeps its (small) scratch per stream: repeated calls on one stream reuse it, each
    stream gets its own, a call under capture allocates its own, and every result equals the first
    call's bit for bit (deterministic). A forward whose lse is dropped writes it into the plan's own
    buffer, never into the out of a call."""
    cupy = pytest.importorskip("cupy")
    import cupyflash
    from cupyflash import api
    case = Case(**CASE, deterministic=True)
    arrays = _check.to_cupy_inputs(case, _check.random_inputs(case, 3))
    q, k, v, dout = (arrays[n] for n in ("q", "k", "v", "dout"))
    out, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True)

    def backward():
        return cupyflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)

    want = [cupy.asnumpy(g) for g in backward()]
    plan = api.plan_of("bwd", dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse), None, True,
                       dict(deterministic=True), "test")  # the calls' cached plan
    assert plan.workspaces[0].keepable  # its plain workspace is small enough to keep
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    for stream in streams:
        with stream:
            for _ in range(3):
                assert all((cupy.asnumpy(g) == w).all() for g, w in zip(backward(), want))
            stream.synchronize()
    kept = {key: workspace.data.ptr for key, workspace in plan.scratch_by_stream.items()}
    assert len({stream for stream, _ in kept}) == len(kept) >= len(streams)  # one per stream
    with streams[0]:
        streams[0].begin_capture()
        captured = backward()
        graph = streams[0].end_capture()
        graph.launch(streams[0])
        streams[0].synchronize()
    assert all((cupy.asnumpy(g) == w).all() for g, w in zip(captured, want))
    assert {key: workspace.data.ptr for key, workspace in plan.scratch_by_stream.items()} == kept
    assert plan.captured_scratch and all(w.data.ptr not in kept.values() for w in plan.captured_scratch[-1])

    outs = [cupyflash.flash_attn_func(q, k, v, causal=True) for _ in range(3)]  # lse dropped
    forward = api.plan_of("fwd", dict(q=q, k=k, v=v), None, True, {}, "test")
    assert all((o == out).all() for o in outs)
    assert forward.sinks["lse"].data.ptr not in {o.data.ptr for o in outs} | {lse.data.ptr}


@pytest.mark.gpu
def test_torch_eager_backward_keeps_scratch_per_stream():
    """The drop-in's eager backward keeps its small scratch per stream, as CuPy's plans do: calls
    on one stream reuse one workspace, another stream gets its own, a captured call allocates its
    own (in the graph's pool) and leaves the kept ones alone, and every result equals the first
    call's bit for bit (deterministic)."""
    torch = pytest.importorskip("torch")
    import cupyflash.torch as cft
    case = Case(**CASE, deterministic=True)
    arrays = {n: torch.as_tensor(a, device="cuda").to(torch.bfloat16)
              for n, a in _check.random_inputs(case, 4).items() if n in ("q", "k", "v", "dout")}

    def step(leaves):
        out = cft.flash_attn_func(*leaves, causal=True, deterministic=True)
        return (out, *torch.autograd.grad(out, leaves, arrays["dout"]))

    cft._resolved.clear()  # so that the one resolved signature is this test's
    leaves = [arrays[n].requires_grad_() for n in ("q", "k", "v")]
    want = step(leaves)
    plans = [plan for resolved in cft._resolved.values() if resolved
             for plan, _ in filter(None, resolved.backward_plans.values())]
    assert len(plans) == 1 and plans[0].workspaces[0].keepable
    plan = plans[0]
    streams = [torch.cuda.Stream() for _ in range(2)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                assert all(torch.equal(x, y) for x, y in zip(step(leaves), want))
        torch.cuda.current_stream().wait_stream(stream)
    kept = {key: workspace.data_ptr() for key, workspace in plan.scratch_by_stream.items()}
    assert len({stream for stream, _ in kept}) == len(kept) >= len(streams) + 1  # the default stream's too
    # Leaves of their own: autograd ties a leaf's gradient node to the stream of its first use.
    captured_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    graph, captured = _torch_capture(torch, lambda: step(captured_leaves))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(captured, want))
    after = {key: workspace.data_ptr() for key, workspace in plan.scratch_by_stream.items()}
    assert {key: after.get(key) for key in kept} == kept
    assert len(after) == len(kept) + 1  # the warm-ups' side stream's; none for the capture
