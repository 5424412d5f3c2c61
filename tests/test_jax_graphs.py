"""CUDA graphs for cupyflash.jax (marked `gpu`): a jitted forward+backward and a jitted varlen forward,
compiled with XLA's command buffers on for custom calls (per program: compiler_options, so no other
test changes), run 100 times with new values written into the program's input buffers (q, k, v,
dout, the dropout seed, the cu_seqlens), so that XLA replays the CUDA graph it recorded. The
custom calls must run inside a command buffer (the optimized HLO shows them there where XLA forms
command buffers in the HLO; the handlers run under XLA's stream capture in any case), their
launches built while tracing (no kernel is compiled or loaded under a capture), and every run must
equal the same program compiled without command buffers: bit for bit for the forward and the
deterministic backward; the default backward adds dq by atomics in no fixed order, so it meets the
project's 3x rule against float64 instead (every tenth run, both backwards: the float64 reference
runs on the host), as tests/test_graphs.py's do. A launch that tracing did not leave for the
handler is built at the first execution, off the capturing thread. Each test prints a JAX-GRAPHS
line: where XLA showed its command buffers, whether it recorded at the first execution, and how
many runs were pure replays (no handler call).
(The test_jax_*.py files are split by concern; test_jax_grad.py lists them.)
"""

import functools
import os
import re
import threading

import numpy
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from cupyflash import _check  # noqa: E402
from cupyflash._check import Case  # noqa: E402
from cupyflash.jax import flash_attn, varlen_forward_with_lse  # noqa: E402
from jax_helpers import _gpu  # noqa: E402

REPLAYS = 100
CASE = dict(seqlen_q=113, seqlen_k=200, headdim=64, dtype="bfloat16", causal=True, batch=2, nheads=4, nheads_k=2)
DROPOUT = 0.17
# XLA's command buffers with custom calls in them, from one command on; and none, for the comparison.
GRAPHS = {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL", "xla_gpu_graph_min_graph_size": 1}
NO_GRAPHS = {"xla_gpu_enable_command_buffer": ""}


@pytest.fixture
def handler_runs(monkeypatch):
    """Every CUDA handler's run of a launch, as (target, whether XLA's stream was capturing), and
    every launch a handler built, as (target, the thread it was built on; the rest were built
    while tracing)."""
    import cupy
    from cupyflash import jax as cfjax
    runs, built = [], []
    run, launch_of = cfjax._Launch.run, cfjax._launch_of

    def recording_run(self, call, device, stream):
        runs.append((self.request.target, cupy.cuda.runtime.streamIsCapturing(stream) != 0))
        return run(self, call, device, stream)

    def recording_launch_of(call, target, *args):
        built.append((target, threading.get_ident()))
        return launch_of(call, target, *args)

    monkeypatch.setattr(cfjax._Launch, "run", recording_run)
    monkeypatch.setattr(cfjax, "_launch_of", recording_launch_of)
    return runs, built


def _write(arrays, values):
    """Writes new values into JAX arrays' device buffers, in place: the program's inputs stay at their
    addresses, so XLA replays its command buffer instead of recording it anew. Returns when the
    device has them (a copy from pageable memory may return before its DMA ends)."""
    import cupy
    for array, value in zip(arrays, values, strict=True):
        host = numpy.ascontiguousarray(numpy.asarray(value).astype(array.dtype))
        assert host.shape == array.shape and host.nbytes == array.nbytes
        cupy.cuda.runtime.memcpy(array.unsafe_buffer_pointer(), host.ctypes.data, host.nbytes,
                                 cupy.cuda.runtime.memcpyHostToDevice)
    cupy.cuda.runtime.deviceSynchronize()


def _seed_words(seed):
    return numpy.array([seed & 0xFFFFFFFF, seed >> 32], numpy.uint32)


def _command_buffer_targets(hlo):
    """The custom call targets inside command buffers in an optimized HLO module, or None where it
    shows no command buffer (XLA may form them from its thunks, after the HLO)."""
    computation, buffers, targets = None, 0, set()
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(1)
            buffers += computation.startswith("command_buffer")
        elif line.startswith("}"):
            computation = None
        elif computation and computation.startswith("command_buffer"):
            targets.update(re.findall(r'custom_call_target="(\w+)"', line))
    return targets if buffers else None


def _compiled_with_graphs(step, args, targets):
    """(the program compiled with command buffers, where they show), after checking that tracing
    built the launches of `targets` and, where the optimized HLO shows command buffers, that they
    hold those calls."""
    from cupyflash import jax as cfjax
    compiled = jax.jit(step, compiler_options=GRAPHS).lower(*args).compile()
    assert targets <= {launch.request.target for launch in cfjax._launches.values() if launch.plan is not None}
    in_buffers = _command_buffer_targets(compiled.as_text())
    if in_buffers is not None:
        assert {t for t in in_buffers if t.startswith("cupyflash")} == targets, in_buffers
    return compiled, "in the optimized HLO" if in_buffers is not None else "not shown in the HLO (formed on thunks)"


def _check_runs(name, built, per_run, targets, where):
    """Every graphed run's handler calls were under XLA's capture, but at most a first execution's
    (a warm-up run before recording); every target was recorded; no launch was built at run time."""
    first = per_run[0]
    later = [call for calls in per_run[1:] for call in calls]
    assert all(capturing for _, capturing in later), f"{name}: a graphed run called a handler outside a capture"
    assert {target for target, capturing in first + later if capturing} == targets, f"{name}: {first + later}"
    assert not built, f"{name}: launches built at run time: {built}"
    replays = sum(not calls for calls in per_run)
    recorded_first = bool(first) and all(capturing for _, capturing in first)
    print(f"JAX-GRAPHS {name}: command buffers {where}; first execution "
          f"{'recorded under capture' if recorded_first else 'ran eagerly (warm-up)'}; "
          f"{replays} of {len(per_run)} runs were pure replays (no handler call)")


def _meets_the_3x_rule(case, inputs, grads, where):
    (_, _, ref_grads), (_, _, lowp_grads) = _check._references(case, inputs, True)
    for name, got, want, lowp in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        bound = 3 * _check._max_error(lowp, want) + _check._floor(case.dtype, want)
        error = _check._max_error(numpy.asarray(got, numpy.float64), want)
        assert error <= bound, f"{where}: {name} error {error:.3g} > {bound:.3g}"


def _host(x):
    return numpy.asarray(x.astype(jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_jax_graph_replays_forward_and_backward(deterministic, handler_runs):
    runs, built = handler_runs
    case = Case(**CASE, dropout_p=DROPOUT, deterministic=deterministic)
    names = ("q", "k", "v", "dout")

    def step(q, k, v, dout, seed):
        attention = functools.partial(flash_attn, causal=True, dropout_p=DROPOUT, dropout_seed=seed,
                                      deterministic=deterministic)
        out, vjp = jax.vjp(attention, q, k, v)
        return (out, *vjp(dout))

    with jax.default_device(_gpu()):
        first = _check.random_inputs(case, 0)
        args = [jnp.array(first[n], jnp.float32).astype(jnp.bfloat16) for n in names]
        args.append(jnp.array(_seed_words(first["seed"])))
        jax.block_until_ready(args)
        targets = {"cupyflash_flash_attn_fwd_graph", "cupyflash_flash_attn_bwd_graph"}
        graphed, where = _compiled_with_graphs(step, args, targets)
        plain = jax.jit(step, compiler_options=NO_GRAPHS)
        per_run = []
        for i in range(REPLAYS):
            inputs = _check.random_inputs(case, 1000 + i)
            _write(args, [inputs[n] for n in names] + [_seed_words(inputs["seed"])])
            del runs[:]
            got = [_host(x) for x in jax.block_until_ready(graphed(*args))]
            per_run.append(runs[:])
            want = [_host(x) for x in jax.block_until_ready(plain(*args))]
            assert numpy.array_equal(got[0], want[0]), f"run {i}: out"
            if deterministic:
                for name, x, y in zip(("dq", "dk", "dv"), got[1:], want[1:]):
                    assert numpy.array_equal(x, y), f"run {i}: {name}"
            if i % 10 == 0:
                _meets_the_3x_rule(case, inputs, got[1:], f"run {i}")
    _check_runs(f"fwd+bwd deterministic={deterministic}", built, per_run, targets, where)


def _splits(i, total):
    """cu_seqlens of three sequences of at most 200 rows that change with i."""
    first = 100 + i % 100
    return numpy.array([0, first, first + (total - first) // 2, total], numpy.int32)


@pytest.mark.gpu
def test_jax_graph_replays_varlen_forward_with_new_cu_seqlens(handler_runs):
    runs, built = handler_runs
    total, longest = 300, 200
    rng = numpy.random.default_rng(7)

    def step(q, k, v, cu):
        return varlen_forward_with_lse(q, k, v, cu, cu, longest, longest, causal=True)

    def fresh_q():
        return rng.standard_normal((total, 4, 64)).astype(numpy.float32)

    with jax.default_device(_gpu()):
        args = [jnp.array(fresh_q()).astype(jnp.bfloat16) for _ in range(3)] + [jnp.array(_splits(0, total))]
        jax.block_until_ready(args)
        targets = {"cupyflash_flash_attn_varlen_fwd_graph"}
        graphed, where = _compiled_with_graphs(step, args, targets)
        plain = jax.jit(step, compiler_options=NO_GRAPHS)
        per_run = []
        for i in range(REPLAYS):
            _write([args[0], args[3]], [fresh_q(), _splits(i, total)])
            del runs[:]
            got = [numpy.asarray(x) for x in jax.block_until_ready(graphed(*args))]
            per_run.append(runs[:])
            want = [numpy.asarray(x) for x in jax.block_until_ready(plain(*args))]
            for name, x, y in zip(("out", "lse"), got, want):
                assert numpy.array_equal(x, y), f"run {i}: {name} at {_splits(i, total)}"
    _check_runs("varlen fwd", built, per_run, targets, where)


@pytest.mark.gpu
def test_jax_graph_builds_a_launch_missing_under_capture(handler_runs, monkeypatch):
    """A launch that tracing did not leave for the handler (here every cache is emptied after
    tracing, as for a program run on another device than it was traced for) is built at the first
    execution: inside XLA's capture, on another thread (its kernels loaded anew there); the results
    equal the program's without command buffers, bit for bit."""
    from cupyflash import _compile, _plan, jax as cfjax
    runs, built = handler_runs
    case = Case(**CASE, deterministic=True)
    targets = {"cupyflash_flash_attn_fwd_graph", "cupyflash_flash_attn_bwd_graph"}

    def step(q, k, v, dout):
        out, vjp = jax.vjp(functools.partial(flash_attn, causal=True, deterministic=True), q, k, v)
        return (out, *vjp(dout))

    with jax.default_device(_gpu()):
        inputs = _check.random_inputs(case, 5)
        args = [jnp.array(inputs[n], jnp.float32).astype(jnp.bfloat16) for n in ("q", "k", "v", "dout")]
        graphed, where = _compiled_with_graphs(step, args, targets)
        moved, on_another_thread = [], cfjax._on_another_thread
        monkeypatch.setattr(cfjax, "_on_another_thread",
                            lambda build: moved.append(threading.get_ident()) or on_another_thread(build))
        for module, cache in ((cfjax, "_launches"), (_plan, "_plans"), (_compile, "_loaded")):
            monkeypatch.setattr(module, cache, {})
        del runs[:]
        got = [_host(x) for x in jax.block_until_ready(graphed(*args))]
        first = runs[:]
        want = [_host(x) for x in jax.block_until_ready(jax.jit(step, compiler_options=NO_GRAPHS)(*args))]
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        assert numpy.array_equal(x, y), name
    assert {target for target, _ in built} == targets
    captured = bool(first) and all(capturing for _, capturing in first)
    if captured:
        assert len(moved) == 2 and not {thread for _, thread in built} & set(moved)
    print(f"JAX-GRAPHS missing launches: command buffers {where}; built at the first execution "
          f"{'under capture, off the capturing thread' if captured else 'outside a capture (warm-up run)'}")
