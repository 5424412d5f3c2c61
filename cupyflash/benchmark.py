"""`python -m cupyflash bench`: cupyflash beside the attention implementations found on this machine.

Method (the FlashAttention papers', as in ../shared/peers/README.md): batch x seqlen = 16384 tokens,
hidden 2048 (nheads = 2048 / headdim), layout (batch, seqlen, nheads, headdim). FLOPs: forward
4 b h s^2 d, halved when causal; backward 2.5x that, timed alone (the backward of an existing
forward); fwd+bwd 3.5x. Timing: CUDA events on PyTorch's current stream around a batch of
back-to-back calls (sized to ~25 ms, so the host's launch work overlaps the GPU's), per-call time =
elapsed / calls, median of 11 batches after a warm-up call (which includes compilation). In each
cell the implementations' batches take turns in a balanced order (median_ms): under load the GPU
runs at its power cap, and a batch timed alone after an idle spell would get higher clocks. JAX has
no stream to put events on: its cells use the host clock around a batch ended by
block_until_ready, and its backward is (fwd+bwd) - fwd. Fresh random inputs per cell; a peer that
fails or is missing gives a blank cell, never a crash. With cupyflash in the run, each peer's output
and gradients are first compared with cupyflash's: a pass whose results are wrong is left blank.
Peers: PyTorch SDPA with each backend, JAX's cuDNN attention, FlashAttention-3 through the
flash_attn3_jax package where it is installed (a wheel; see bench/notes/v08-two-stage-forward-and-heavy-blocks-first.md),
and FlashAttention-4 (flash-attn-4, CuTe-DSL) where it is installed (../shared/peers/fa4/README.md
carries it to the GPU machine). The speed table's ratio that matters is against the best peer of
each cell; the FA2 ratio stays beside it.

Decode (`bench --decode`): TB/s of the KV cache read per step, every implementation timed as
replays of a CUDA graph of back-to-back steps (GraphTimer), as a serving loop runs them; see
run_decode.

Host time (`bench --host`): microseconds of host time per call of each way of calling cupyflash
(the core on CuPy arrays and on torch tensors, cupyflash.torch eager, through its custom ops and
compiled, cupyflash.jax under jit) beside SDPA flash and JAX cuDNN, at three small shapes; see
run_host.

Memory: peak device memory of fwd+bwd beyond the inputs, batch 1, 16 heads, head dim 128, against
seqlen, for cupyflash and for naive attention (PyTorch's math backend, which builds the full score
matrix).
"""

import contextlib
import cProfile
import csv
import dataclasses
import itertools
import math
import os
import pstats
import sys
import time

import numpy

PASSES = ("fwd", "bwd", "fwd+bwd")
PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
TOKENS, HIDDEN = 16384, 2048


def attention_flops(batch, nheads, seqlen, headdim, causal, pass_):
    return 4 * batch * nheads * seqlen ** 2 * headdim / (2 if causal else 1) * PASS_FLOP_FACTOR[pass_]


class BatchTimer:
    """Times batches of back-to-back calls of `fn`. Making one runs the warm-up call (compilation
    included) and sizes the batch to about `target_ms`.

    Without `sync`, `fn` must launch on PyTorch's current stream (events are recorded there);
    with `sync` (a function that waits for the work of the last call), the host clock is used."""

    def __init__(self, fn, sync=None, target_ms=25.0):
        self.fn, self.sync = fn, sync
        self.calls = 1
        self.batch_ms()  # warm-up
        self.calls = max(1, min(1000, int(target_ms / max(self.batch_ms(), 1e-3))))

    def batch_ms(self):
        """Per-call milliseconds of one batch."""
        import torch
        if self.sync is None:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.calls):
                self.fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / self.calls
        begin = time.perf_counter()
        for _ in range(self.calls):
            result = self.fn()
        self.sync(result)
        return (time.perf_counter() - begin) * 1e3 / self.calls


class GraphTimer:
    """Times replays of a CUDA graph (torch's) of back-to-back calls of `fn`, sized to about
    `target_ms` a replay: the GPU's time per call with no host work between the calls, as a serving
    loop that replays its decode step sees it. Making one runs the warm-up call outside the capture
    (compilation, plans); `fn` must launch on PyTorch's current stream and read nothing on the host."""

    def __init__(self, fn, target_ms=25.0):
        import torch
        side = torch.cuda.Stream()  # warmed up on a side stream, as torch's capture asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.synchronize()
        self.calls, self.graph = 1, self._captured(fn, 1)
        self.batch_ms()  # the first replay uploads the graph
        self.calls = max(1, min(200, int(target_ms / max(self.batch_ms(), 1e-3))))
        self.graph = self._captured(fn, self.calls)
        self.batch_ms()

    @staticmethod
    def _captured(fn, calls):
        import torch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return graph

    def batch_ms(self):
        """Per-call milliseconds of one replay."""
        import torch
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / self.calls


def balanced_order(items, round_):
    """`items` in round `round_`'s order, from a Williams design (a balanced Latin square): over a
    cycle of n rounds (2n for odd n items) each item takes every position equally often and follows
    every other item equally often. Under the power cap a batch's clocks depend on the batch before
    it, so a timer that always ran after the same one (as seeded shuffles repeat in every cell)
    would carry that one's bias."""
    n = len(items)
    if n == 0:  # every timer failed
        return []
    first = [0]  # 0, 1, n-1, 2, n-2, ...
    for i in range(1, n):
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    row = [items[(x + round_) % n] for x in first]
    return row[::-1] if n % 2 and round_ // n % 2 else row


def median_ms(timers, reps=5, report=print):
    """{key: median per-call milliseconds} of `timers` ({key: BatchTimer}) over `reps` rounds. A
    round times one batch of every timer, in a balanced order (balanced_order), so that a slow
    spell of the GPU falls on all of them alike: under load the H200 sits at its power cap, and the
    batch that follows a power-hungry one starts at lower clocks. A timer that fails is reported
    and left out."""
    samples = {key: [] for key in timers}
    for round_ in range(reps):
        for key in balanced_order(list(samples), round_):
            try:
                samples[key].append(timers[key].batch_ms())
            except Exception as error:
                report(f"  {key} failed while timed: {type(error).__name__}: {str(error)[:120]}")
                del samples[key]
    return {key: float(numpy.median(values)) for key, values in samples.items()}


def _add_derived_bwd(times, timers, impl):
    """For an implementation whose backward cannot be timed alone (JAX's: no bwd timer among
    `timers`): bwd = (fwd+bwd) - fwd, where both were timed."""
    if (impl, "bwd") not in timers and {(impl, "fwd"), (impl, "fwd+bwd")} <= times.keys():
        times[impl, "bwd"] = times[impl, "fwd+bwd"] - times[impl, "fwd"]


def time_ms(fn, reps=5, target_ms=25.0, sync=None):
    """Median per-call milliseconds of `fn` over `reps` batches of back-to-back calls."""
    return median_ms({fn: BatchTimer(fn, sync, target_ms)}, reps)[fn]


# ----------------------------------------------------------------------------------- implementations
# Each takes torch tensors q, k, v, dout (batch, seqlen, nheads, headdim) and returns its Calls.

@dataclasses.dataclass
class Calls:
    timed: dict       # {pass: (callable, sync or None)}: each callable does the work of one call
    results: object   # () -> (out, (dq, dk, dv)), torch tensors (batch, seqlen, nheads, headdim)


def _cupyflash(q, k, v, dout, causal):
    from . import flash_attn_backward, flash_attn_func
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)

    def both():
        o, l = flash_attn_func(q, k, v, causal=causal, return_lse=True)
        return flash_attn_backward(dout, q, k, v, o, l, causal=causal)
    return Calls({"fwd": (lambda: flash_attn_func(q, k, v, causal=causal), None),
                  "bwd": (lambda: flash_attn_backward(dout, q, k, v, out, lse, causal=causal), None),
                  "fwd+bwd": (both, None)},
                 lambda: (out, both()))


def _autograd_calls(forward, inputs, dout, to_caller=lambda x: x):
    """Calls of a torch `forward()` differentiated by autograd with respect to `inputs`: the forward,
    the backward of one saved output, and both; results through `to_caller` (the caller's layout)."""
    import torch
    out = forward()

    def both():
        return torch.autograd.grad(forward(), inputs, dout)
    return Calls({"fwd": (forward, None),
                  "bwd": (lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True), None),
                  "fwd+bwd": (both, None)},
                 lambda: (to_caller(out), [to_caller(g) for g in both()]))


def _sdpa(backend_name):
    def make(q, k, v, dout, causal):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))  # SDPA's (b, h, s, d)

        def forward():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        return _autograd_calls(forward, (qt, kt, vt), dout.transpose(1, 2), lambda x: x.transpose(1, 2))
    return make


def _jax_calls(attention, q, k, v, dout):
    """Calls of a JAX attention function of (q, k, v), on the tensors shared through DLPack (no bwd
    alone: the benchmark takes (fwd+bwd) - fwd)."""
    import jax
    import jax.dlpack
    import torch
    qj, kj, vj, doj = (jax.dlpack.from_dlpack(x.contiguous()) for x in (q, k, v, dout))
    forward = jax.jit(attention)
    both = jax.jit(lambda q, k, v, do: jax.vjp(attention, q, k, v)[1](do))
    sync = jax.block_until_ready
    return Calls({"fwd": (lambda: forward(qj, kj, vj), sync), "fwd+bwd": (lambda: both(qj, kj, vj, doj), sync)},
                 lambda: (torch.from_dlpack(forward(qj, kj, vj)), [torch.from_dlpack(g) for g in both(qj, kj, vj, doj)]))


def _jax_cudnn(q, k, v, dout, causal):
    import jax
    return _jax_calls(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
                      q, k, v, dout)


def _fa3_jax(q, k, v, dout, causal):
    """FlashAttention-3 (Hopper's wgmma kernels) from the flash_attn3_jax package, where it is installed."""
    _restore_jax_core_shaped_array()
    from flash_attn3_jax import flash_mha
    return _jax_calls(lambda q, k, v: flash_mha(q, k, v, is_causal=causal), q, k, v, dout)


def _fa4(q, k, v, dout, causal, **options):
    """FlashAttention-4 (flash_attn.cute from flash-attn-4), where it is installed; it takes and gives
    (batch, seqlen, nheads, headdim) tensors and differentiates through autograd. `options` are its
    other keywords (softcap, window_size)."""
    from flash_attn.cute import flash_attn_func
    qt, kt, vt = (x.detach().requires_grad_() for x in (q, k, v))

    def forward():
        result = flash_attn_func(qt, kt, vt, causal=causal, **options)
        return result[0] if isinstance(result, tuple) else result
    return _autograd_calls(forward, (qt, kt, vt), dout)


def _restore_jax_core_shaped_array():
    """flash_attn3_jax 0.2.3 imports jax.core.ShapedArray, which newer JAX keeps only in jax._src.core."""
    import jax.core
    if not hasattr(jax.core, "ShapedArray"):
        import jax._src.core
        jax.core.ShapedArray = jax._src.core.ShapedArray


def _wrong_results(calls, expected):
    """The passes whose results disagree with `expected` (cupyflash's (out, grads), itself tested
    against the float64 reference), far beyond the 16-bit rounding two correct kernels differ by."""
    out, grads = calls.results()
    wrong = set() if _agrees(out, expected[0]) else {"fwd", "fwd+bwd"}
    if not all(_agrees(g, e) for g, e in zip(grads, expected[1])):
        wrong |= {"bwd", "fwd+bwd"}
    return wrong


IMPLEMENTATIONS = {
    "cupyflash": _cupyflash,
    "SDPA flash (FA2)": _sdpa("FLASH_ATTENTION"),
    "SDPA cuDNN": _sdpa("CUDNN_ATTENTION"),
    "SDPA mem-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "JAX cuDNN": _jax_cudnn,
    "FA3 (flash_attn3_jax)": _fa3_jax,
    "FA4 (flash-attn-4)": _fa4,
}
REFERENCE_PEER = "SDPA flash (FA2)"


@dataclasses.dataclass
class Row:
    impl: str
    dtype: str
    headdim: int
    seqlen: int
    causal: bool
    pass_: str
    ms: float            # NaN when the implementation failed or is missing
    tflops: float


def speed_cells(headdims, seqlens, dtypes, causals=(False, True)):
    """The (dtype, head dim, seqlen, causal) cells of a speed table, in the order they run."""
    return [(d, hd, s, c) for d in dtypes for hd in headdims for s in seqlens for c in causals]


def run_speed(headdims=(64, 128, 256), seqlens=(512, 1024, 2048, 4096, 8192, 16384), dtypes=("bfloat16", "float16"),
              causals=(False, True), impls=tuple(IMPLEMENTATIONS), passes=PASSES, report=print):
    """[Row] of every cell, implementation and pass. Ctrl-C (or SIGINT from a time limit) ends the run
    early with the cells done so far."""
    rows, missing = [], set()
    cells = speed_cells(headdims, seqlens, dtypes, causals)
    try:
        for index, cell in enumerate(cells, 1):
            rows += _speed_cell(*cell, impls, passes, missing, f"{index}/{len(cells)}", report)
    except KeyboardInterrupt:
        report(f"speed: interrupted after {len(rows) // max(1, len(impls) * len(passes))} of {len(cells)} cells")
    return rows


def _speed_cell(dtype, hd, seqlen, causal, impls, passes, missing, progress, report):
    """run_speed's rows of one cell; `missing` collects the peers found not installed."""
    import torch
    rows = []
    batch, nheads = TOKENS // seqlen, HIDDEN // hd
    torch_dtype = getattr(torch, dtype)
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, hd, device="cuda", dtype=torch_dtype) for _ in range(4))
    timers, expected = {}, None
    # cupyflash first: its results are what the peers' are checked against
    for impl in sorted((i for i in impls if i not in missing), key=lambda i: i != "cupyflash"):
        try:
            calls = IMPLEMENTATIONS[impl](q, k, v, dout, causal)
            if impl == "cupyflash":
                expected = calls.results()
            wrong = _wrong_results(calls, expected) if expected is not None and impl != "cupyflash" else set()
            if wrong:
                report(f"  {impl} gives wrong results at {dtype} hd{hd} s{seqlen} causal={causal} "
                       f"({', '.join(sorted(wrong))}): those cells are left blank")
            timers.update({(impl, pass_): BatchTimer(fn, sync)
                           for pass_, (fn, sync) in calls.timed.items() if pass_ in passes and pass_ not in wrong})
        except ImportError as error:  # a peer not installed here: blank cells, said once
            missing.add(impl)
            report(f"  {impl} is not available: {error}")
        except Exception as error:  # a failing peer is a blank cell
            report(f"  {impl} failed at {dtype} hd{hd} s{seqlen} causal={causal}: {type(error).__name__}: "
                   f"{str(error).splitlines()[0][:120] if str(error) else ''}")
    # The implementations' batches take turns (median_ms): a cell's ratios compare times
    # taken in the same seconds, under the same power cap. With 7 rounds a cell's ratio moved
    # by up to 5% between runs; 11 take about 2 minutes more.
    times = median_ms(timers, reps=11, report=report)
    for impl in impls:
        _add_derived_bwd(times, timers, impl)
    calls = timers = None  # the cell's tensors go before the next cell's
    torch.cuda.empty_cache()
    for impl in impls:
        for pass_ in passes:
            ms = times.get((impl, pass_), math.nan)
            flops = attention_flops(batch, nheads, seqlen, hd, causal, pass_)
            rows.append(Row(impl, dtype, hd, seqlen, causal, pass_, ms, flops / ms / 1e9))
    ours = {p: times.get(("cupyflash", p), math.nan) for p in passes}
    peer = {p: times.get((REFERENCE_PEER, p), math.nan) for p in passes}
    report(f"[{progress}] {dtype} hd{hd} s{seqlen}{' causal' if causal else ''}: "
           + "  ".join(f"{p} {peer[p] / ours[p]:.2f}x FA2" for p in passes))
    return rows


def run_memory(seqlens=(1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072), nheads=16, headdim=128,
               dtype="bfloat16", report=print):
    """[(seqlen, implementation, extra MiB or NaN)] for one fwd+bwd, batch 1."""
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from . import flash_attn_backward, flash_attn_func
    pool = cupy.get_default_memory_pool()
    results = []
    for seqlen in seqlens:
        q, k, v, dout = (torch.randn(1, seqlen, nheads, headdim, device="cuda", dtype=getattr(torch, dtype))
                         for _ in range(4))

        def cupyflash_step():
            out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
            flash_attn_backward(dout, q, k, v, out, lse, causal=True)

        def naive_step():
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.MATH):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            torch.autograd.grad(out, (qt, kt, vt), dout.transpose(1, 2))

        for name, step in (("cupyflash", cupyflash_step), ("naive (PyTorch math)", naive_step)):
            torch.cuda.synchronize()
            pool.free_all_blocks()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                step()
                torch.cuda.synchronize()
                # torch's peak covers torch allocations (outputs, for torch inputs); CuPy's pool holds
                # cupyflash's own temporaries (the dq accumulator, D) until freed.
                extra = torch.cuda.max_memory_allocated() - base + pool.total_bytes()
                results.append((seqlen, name, extra / 2 ** 20))
            except Exception as error:  # out of memory: a blank cell
                results.append((seqlen, name, math.nan))
                report(f"  {name} failed at seqlen {seqlen}: {type(error).__name__}")
            torch.cuda.empty_cache()
        report(f"memory seqlen {seqlen}: " + ", ".join(f"{n} {m:.0f} MiB" for s, n, m in results if s == seqlen))
    return results


# ---------------------------------------------------------------------------------------- options
# One row per attention option at head dim 128, bf16, 16384 tokens (16 heads), beside the plain
# kernel and beside a peer that has the option. Times are per call (ms); "vs plain" divides by the
# plain non-causal kernel's time at the same seqlen (the window row's 35% bound is on that ratio).

OPTION_WINDOW = 4096


def _option_calls(seqlen, headdim, nheads, batch):
    """{option: (cupyflash fwd kwargs, bwd kwargs, peer name or None, peer maker or None)}."""
    import torch
    bias = torch.randn(batch, nheads, seqlen, seqlen, device="cuda", dtype=torch.bfloat16)
    slopes = torch.rand(nheads, device="cuda", dtype=torch.float32) * 0.1
    seed = dict(seed=1234)
    window = dict(causal=True, window_size=(OPTION_WINDOW, 0))
    return {
        "plain": (dict(), dict(), "SDPA flash (FA2)", dict(backend="FLASH_ATTENTION")),
        "causal": (dict(causal=True), dict(causal=True), "SDPA flash (FA2)", dict(backend="FLASH_ATTENTION", causal=True)),
        f"sliding window {OPTION_WINDOW} (causal)": (window, window, "JAX cuDNN", dict(jax_window=(OPTION_WINDOW, 0))),
        f"sliding window {OPTION_WINDOW} (causal), beside FA4": (
            window, window, "FA4 (flash-attn-4)", dict(fa4=dict(causal=True, window_size=(OPTION_WINDOW, 0)))),
        "softcap 30": (dict(softcap=30.0), dict(softcap=30.0), "FA4 (flash-attn-4)", dict(fa4=dict(softcap=30.0))),
        "alibi": (dict(alibi_slopes=slopes), dict(alibi_slopes=slopes), None, None),
        "attn_bias (b, h, s, s) bf16": (dict(attn_bias=bias), dict(attn_bias=bias, return_dbias=True),
                                        "SDPA mem-efficient", dict(backend="EFFICIENT_ATTENTION", mask=bias)),
        "dropout 0.1": (dict(dropout_p=0.1, **seed), dict(dropout_p=0.1, **seed),
                        "SDPA flash (FA2)", dict(backend="FLASH_ATTENTION", dropout_p=0.1)),
        "deterministic bwd": (dict(), dict(deterministic=True), None, None),
        "varlen (equal lengths)": (dict(varlen=True), dict(varlen=True), None, None),
    }


def _cupyflash_option(q, k, v, dout, fwd_kwargs, bwd_kwargs):
    from . import flash_attn_backward, flash_attn_func, flash_attn_varlen_backward, flash_attn_varlen_func
    if fwd_kwargs.get("varlen"):
        import torch
        batch, seqlen = q.shape[:2]
        cu = torch.arange(0, (batch + 1) * seqlen, seqlen, device="cuda", dtype=torch.int32)
        packed = [x.reshape(batch * seqlen, *x.shape[2:]) for x in (q, k, v, dout)]
        out, lse = flash_attn_varlen_func(*packed[:3], cu, cu, seqlen, seqlen, return_lse=True)
        return {"fwd": lambda: flash_attn_varlen_func(*packed[:3], cu, cu, seqlen, seqlen),
                "bwd": lambda: flash_attn_varlen_backward(packed[3], *packed[:3], out, lse, cu, cu, seqlen, seqlen)}
    out, lse = flash_attn_func(q, k, v, return_lse=True, **fwd_kwargs)
    return {"fwd": lambda: flash_attn_func(q, k, v, **fwd_kwargs),
            "bwd": lambda: flash_attn_backward(dout, q, k, v, out, lse, **bwd_kwargs)}


def _peer_option(q, k, v, dout, spec):
    """fwd / bwd callables of a peer with an option, with their sync (None: torch's stream)."""
    if "fa4" in spec:
        calls = _fa4(q, k, v, dout, **{"causal": False, **spec["fa4"]})
        return {pass_: calls.timed[pass_] for pass_ in ("fwd", "bwd")}
    if "jax_window" in spec:
        import jax
        return _jax_calls(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=spec["jax_window"], implementation="cudnn"), q, k, v, dout).timed
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    mask = spec.get("mask")
    if mask is not None:
        mask = mask.detach().requires_grad_()

    def forward():
        with sdpa_kernel(getattr(SDPBackend, spec["backend"])):
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=spec.get("causal", False),
                                                  dropout_p=spec.get("dropout_p", 0.0))
    inputs = (qt, kt, vt) + ((mask,) if mask is not None else ())
    calls = _autograd_calls(forward, inputs, dout.transpose(1, 2))
    return {pass_: calls.timed[pass_] for pass_ in ("fwd", "bwd")}


def selected_options(names, words=None):
    """The option rows to time: those whose name contains one of `words` (all when None), and the
    plain row, which every ratio divides by."""
    return [name for name in names if words is None or name == "plain" or any(w in name for w in words)]


def run_options(seqlens=(4096, 16384), headdim=128, report=print, words=None):
    """[(option, seqlen, pass, cupyflash ms, peer name, peer ms, plain ms)] at bf16, 16 heads, 16384
    tokens, of the rows selected_options(words) keeps. Each row times the plain kernels in turns
    with its own (plain ms): under the power cap a batch's clocks depend on what ran before it, so a
    ratio is taken between kernels that shared their rounds."""
    import torch
    results = []
    nheads = 16
    for seqlen in seqlens:
        batch = TOKENS // seqlen
        q, k, v, dout = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        calls = _option_calls(seqlen, headdim, nheads, batch)
        plain = {("plain", pass_): BatchTimer(fn) for pass_, fn in _cupyflash_option(q, k, v, dout, {}, {}).items()}
        for option in selected_options(calls, words):
            fwd_kwargs, bwd_kwargs, peer, spec = calls[option]
            timers = dict(plain)
            try:
                for pass_, fn in _cupyflash_option(q, k, v, dout, fwd_kwargs, bwd_kwargs).items():
                    timers["cupyflash", pass_] = BatchTimer(fn)
            except Exception as error:
                report(f"  cupyflash failed at {option} s{seqlen}: {type(error).__name__}: {str(error)[:160]}")
            if peer is not None:
                try:
                    for pass_, (fn, sync) in _peer_option(q, k, v, dout, spec).items():
                        timers[peer, pass_] = BatchTimer(fn, sync)
                except Exception as error:
                    report(f"  {peer} failed at {option} s{seqlen}: {type(error).__name__}: {str(error)[:160]}")
            # Whole cycles of the balanced order: 4 timers, 6 with a peer (bench/notes/v82: with 5
            # rounds in orders every row repeated, the plain row's backward read 6-9% off itself).
            times = median_ms(timers, reps=12, report=report)
            _add_derived_bwd(times, timers, peer)
            timers = None
            for pass_ in ("fwd", "bwd"):
                results.append((option, seqlen, pass_, times.get(("cupyflash", pass_), math.nan), peer or "",
                                times.get((peer, pass_), math.nan), times.get(("plain", pass_), math.nan)))
            torch.cuda.empty_cache()
            report(f"options s{seqlen} {option}: " + ", ".join(f"{p} {times.get(('cupyflash', p), math.nan):.3f} ms"
                                                              for p in ("fwd", "bwd")))
    return results


def write_options(results, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "options.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["option", "seqlen", "pass", "cupyflash_ms", "peer", "peer_ms", "plain_ms"])
        writer.writerows([o, s, p, f"{ms:.4f}", peer, f"{pms:.4f}", f"{plain:.4f}"]
                         for o, s, p, ms, peer, pms, plain in results)
    lines = [f"bf16, head dim 128, 16 heads, {TOKENS} tokens; ms per call (median); 'vs plain' = time / the plain "
             f"non-causal kernel's time at that seqlen, timed in turns with the row's kernels (in the plain row: "
             f"two timers of one call, the table's noise).", "",
             "| option | seqlen | pass | cupyflash ms | vs plain | peer | peer ms | cupyflash speed-up over peer |",
             "|---|---|---|---|---|---|---|---|"]
    for option, seqlen, pass_, ms, peer, peer_ms, plain_ms in results:
        lines.append(f"| {option} | {seqlen} | {pass_} | {ms:.3f} | {ms / plain_ms:.2f} | {peer} | "
                     f"{'' if math.isnan(peer_ms) else f'{peer_ms:.3f}'} | "
                     f"{'' if math.isnan(peer_ms) else f'{peer_ms / ms:.2f}x'} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "options.md"), "w") as f:
        f.write(text)
    return text


# ------------------------------------------------------------------------------------------- host
# Host time per call: what each way of calling cupyflash costs the host, beside SDPA flash and JAX
# cuDNN, at shapes small enough that the host sets the pace (where a call's GPU work takes longer,
# as it can at the large shape, the figure is the GPU's time). Timing: `calls` back-to-back calls
# after the warm-up (which takes any torch.compile or jax.jit compilation), synchronised once at the
# end, wall time / calls; the columns take turns in balanced orders (median_ms's), and a cell is the
# median of its HOST_REPS turns. The lent hosts' speed wanders: one call read 2x apart between
# consecutive turns of a process (bench/notes/v43), so many short interleaved turns, not a few.

HOST_SHAPES = {"small": (1, 128, 8, 64), "medium": (4, 512, 16, 128), "large": (8, 2048, 16, 128)}
HOST_PASSES = ("fwd", "fwd+bwd")
HOST_CALLS, HOST_REPS = 200, 15
# At least 3 (CUDA graph trees record on the second call and replay from the third), and enough
# back-to-back work for the GPU to leave its idle clocks, which would make tiny kernels the bound.
HOST_WARMUP = 50
HOST_SPIN_S = 2.0  # the host and the GPU kept busy before the first cell (run_host_here)
HOST_TARGETS = ("cupyflash.torch eager fwd+bwd <= 1.2x SDPA flash and fwd <= 1.3x SDPA flash; cupyflash core fwd "
                "(CuPy) <= 20 us at 1x128x8x64; cupyflash.jax fwd+bwd <= 1.2x JAX cuDNN")


def host_shape(spec):
    """(batch, seqlen, nheads, headdim) of a --host-shapes entry: a name of HOST_SHAPES or BxSxHxD."""
    if spec in HOST_SHAPES:
        return HOST_SHAPES[spec]
    parts = spec.split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"a host shape is one of {', '.join(HOST_SHAPES)} or BxSxHxD (e.g. 2x256x8x64), got {spec!r}")
    return tuple(map(int, parts))


def _shape_text(shape):
    return "x".join(map(str, shape))


@dataclasses.dataclass
class HostCall:
    fn: object                                # the work of one call
    sync: object                              # (last result) -> returns once the device has done every call
    context: object = contextlib.nullcontext  # () -> a context entered once around the warm-up and the timing
    caveat: object = None                     # () -> a note on the figure, asked after the timing, or ""


@dataclasses.dataclass
class HostCell:
    shape: tuple
    pass_: str
    column: str
    us: float       # NaN when the cell could not run
    note: str = ""  # why it could not, or a caveat of its figure


def _torch_sync(q):
    import torch
    return (lambda result: torch.cuda.synchronize()) if q.is_cuda else (lambda result: None)


# Each column makes the HostCall of a pass from torch tensors q, k, v, dout (batch, seqlen, nheads,
# headdim), or None where it has no such pass.

def _host_core_cupy(q, k, v, dout, pass_):
    import cupy
    from ._arrays import bfloat16_dtype
    arrays = (cupy.random.standard_normal(q.shape, dtype=cupy.float32).astype(bfloat16_dtype()) for _ in range(4))
    fn, _ = _cupyflash(*arrays, causal=True).timed[pass_]
    return HostCall(fn, lambda result: cupy.cuda.Device().synchronize())


def _host_timed(make_calls):
    """The column of a speed-table implementation: its call of the pass, with its own sync (JAX's)
    or the device's."""
    def make(q, k, v, dout, pass_):
        fn, sync = make_calls(q, k, v, dout, True).timed[pass_]
        return HostCall(fn, sync or _torch_sync(q))
    return make


def _cupyflash_jax(q, k, v, dout, causal):
    from .jax import flash_attn
    return _jax_calls(lambda q, k, v: flash_attn(q, k, v, causal=causal), q, k, v, dout)


def _host_torch_eager(requires_grad):
    def make(q, k, v, dout, pass_):
        if pass_ != "fwd" and not requires_grad:
            return None
        import torch
        from .torch import flash_attn_func
        qg, kg, vg = (x.detach().requires_grad_(requires_grad) for x in (q, k, v))

        def forward():
            return flash_attn_func(qg, kg, vg, causal=True)

        def both():
            return torch.autograd.grad(forward(), (qg, kg, vg), dout)
        return HostCall(forward if pass_ == "fwd" else both, _torch_sync(q))
    return make


@contextlib.contextmanager
def _through_the_ops():
    """cupyflash.torch's eager calls go through its custom ops, as traced and transformed calls do."""
    from . import torch as cupyflash_torch
    eager, cupyflash_torch._eager = cupyflash_torch._eager, lambda *tensors: False
    try:
        yield
    finally:
        cupyflash_torch._eager = eager


def _host_torch_floor(q, k, v, dout, pass_):
    """A bare autograd.Function with the eager path's saves and allocations and no kernels: the host
    time below which no Python-level torch path goes (the autograd engine, its thread hand-offs)."""
    import torch
    stats = (q.shape[0], q.shape[2], q.shape[1])

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = torch.empty_like(q), q.new_empty(stats, dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            q.new_empty((q.numel() + 2 * lse.numel(),), dtype=torch.float32)  # the scratch: dq_accum, D, lse
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def forward():
        return Floor.apply(qg, kg, vg)

    def both():
        return torch.autograd.grad(forward(), (qg, kg, vg), dout)
    return HostCall(forward if pass_ == "fwd" else both, _torch_sync(q))


def _host_torch_ops(q, k, v, dout, pass_):
    return dataclasses.replace(_host_torch_eager(True)(q, k, v, dout, pass_), context=_through_the_ops)


def _host_torch_compiled(mode):
    """The drop-in's forward under torch.compile(fullgraph=True); fwd+bwd differentiates its output
    outside, through AOTAutograd's compiled backward, as a training step does (torch.autograd.grad
    inside a fullgraph region is off by default: torch._dynamo.config.trace_autograd_ops)."""
    def make(q, k, v, dout, pass_):
        import torch
        import torch._dynamo
        from .torch import flash_attn_func
        # Each cell compiles afresh: its own shape, static, within the recompile limit, in its mode.
        torch._dynamo.reset()
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True, mode=mode)
        # CUDA graphs replay over fixed input addresses (hence the same tensors every call); the step
        # mark lets a replay overwrite the outputs of the call before.
        graphs = mode == "reduce-overhead"
        step = torch.compiler.cudagraph_mark_step_begin if graphs else (lambda: None)

        def forward():
            step()
            return compiled(qg, kg, vg)

        def both():
            step()
            return torch.autograd.grad(compiled(qg, kg, vg), (qg, kg, vg), dout)
        counters = torch._dynamo.utils.counters["inductor"]
        skips = counters["cudagraph_skips"]

        def caveat():
            skipped = graphs and counters["cudagraph_skips"] > skips
            return "CUDA graphs skipped (TORCH_LOGS=cudagraphs says why)" if skipped else ""
        return HostCall(forward if pass_ == "fwd" else both, _torch_sync(q), caveat=caveat)
    return make


def _host_sdpa_flash(compiled):
    """SDPA flash eagerly, or under torch.compile(fullgraph=True) as _host_torch_compiled compiles
    cupyflash's: what torch.compile's own layers cost a call of either."""
    def make(q, k, v, dout, pass_):
        import torch
        import torch._dynamo
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))  # SDPA's (b, h, s, d), views
        dot = dout.transpose(1, 2)
        attention = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        if compiled:
            torch._dynamo.reset()
            attention = torch.compile(attention, fullgraph=True)

        def forward():
            return attention(qt, kt, vt)

        def both():
            return torch.autograd.grad(forward(), (qt, kt, vt), dot)
        # The backend is picked once around the calls: the context manager's cost is not the call's.
        return HostCall(forward if pass_ == "fwd" else both, _torch_sync(q),
                        lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION))
    return make


HOST_COLUMNS = {  # name: (maker, what a call does)
    "cupyflash core (CuPy)": (_host_core_cupy, "cupyflash.flash_attn_func on CuPy arrays; fwd+bwd: the forward "
                                               "with return_lse=True, then cupyflash.flash_attn_backward"),
    "cupyflash core (torch)": (_host_timed(_cupyflash), "the same on torch tensors"),
    "cupyflash.torch eager": (_host_torch_eager(True), "cupyflash.torch.flash_attn_func on tensors that require "
                                                       "grad; fwd+bwd: torch.autograd.grad(out, (q, k, v), dout)"),
    "cupyflash.torch fwd (no grad)": (_host_torch_eager(False), "the same forward on tensors that do not require "
                                                                "grad (fwd only)"),
    "torch Function floor": (_host_torch_floor, "a bare torch.autograd.Function with the eager column's saves and "
                                                "allocations and no kernels: the floor of any Python-level path"),
    "cupyflash.torch via ops": (_host_torch_ops, "the eager calls through the custom ops (the dispatcher), as "
                                                 "torch.compile and functorch transforms call them"),
    "cupyflash.torch compiled": (_host_torch_compiled(None),
                                 "torch.compile(fullgraph=True) of the eager column's forward; fwd+bwd: "
                                 "torch.autograd.grad of its output (AOTAutograd's compiled backward)"),
    "cupyflash.torch reduce-overhead": (_host_torch_compiled("reduce-overhead"),
                                        "the same with mode='reduce-overhead' (CUDA graphs): the same tensors "
                                        "each call, torch.compiler.cudagraph_mark_step_begin() before each"),
    "cupyflash.jax jit": (_host_timed(_cupyflash_jax), "jax.jit of cupyflash.jax.flash_attn; fwd+bwd: jax.jit of "
                                                       "jax.vjp's gradients of q, k, v"),
    "SDPA flash": (_host_sdpa_flash(False), "F.scaled_dot_product_attention(is_causal=True) under "
                                            "sdpa_kernel(SDPBackend.FLASH_ATTENTION), on (b, h, s, d) views that "
                                            "require grad"),
    "SDPA flash compiled": (_host_sdpa_flash(True), "the same under torch.compile(fullgraph=True), as the "
                                                    "compiled cupyflash column"),
    "JAX cuDNN": (_host_timed(_jax_cudnn), "jax.jit of jax.nn.dot_product_attention(implementation='cudnn'); "
                                           "fwd+bwd as for cupyflash.jax"),
}
HOST_RATIOS = (("cupyflash.torch eager", "SDPA flash"), ("cupyflash.torch compiled", "SDPA flash compiled"),
               ("cupyflash.jax jit", "JAX cuDNN"))
# Column groups timed each in a process of their own: with JAX's runtime started, every torch
# column read 1.1-1.3x slower on the same host, SDPA's too (bench/notes/v43); torch.compile starts
# a pool of compile workers during the first shape's warm-up, the suspect for that shape's slow
# cells (bench/notes/v45; not yet measured apart).
HOST_PROCESS_GROUPS = (("cupyflash.torch compiled", "cupyflash.torch reduce-overhead", "SDPA flash compiled"),
                       ("cupyflash.jax jit", "JAX cuDNN"))


def _busy(seconds, device=None):
    """Keeps the host busy for `seconds`, and the GPU `device` too where given: clocks rise under
    load, and the first cells timed after an idle spell read high without it. (The table's first
    shape read 1.2-1.4x slow whichever it was, v42-v45, after the host alone was kept busy; a GPU
    left idle at low clocks makes its small calls' kernels the bound.)"""
    end = time.perf_counter() + seconds
    if device is None:
        while time.perf_counter() < end:
            pass
        return
    import torch
    x = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    while time.perf_counter() < end:
        for _ in range(8):  # about 1 ms of products a round; the wait keeps the host busy too
            torch.mm(x, x)
        torch.cuda.synchronize(device)


def _warm_up(call):
    with call.context():
        for _ in range(HOST_WARMUP):
            result = call.fn()
        call.sync(result)


def _host_turn(call, calls):
    """The wall time of `calls` back-to-back calls, synchronised once at the end, per call, in
    microseconds."""
    with call.context():
        begin = time.perf_counter()
        for _ in range(calls):
            result = call.fn()
        call.sync(result)
        return (time.perf_counter() - begin) / calls * 1e6


def profile_host(call, calls=HOST_CALLS, top=25):
    """cProfile's `top` functions by own time over `calls` calls after a warm-up, as a table in
    microseconds per call (own time, cumulative time) and times run per call. cProfile's own cost
    inflates every figure: compare rows, not totals with the timed ones."""
    profile = cProfile.Profile()
    with call.context():
        for _ in range(HOST_WARMUP):
            result = call.fn()
        call.sync(result)
        profile.enable()
        for _ in range(calls):
            result = call.fn()
        call.sync(result)
        profile.disable()
    stats = pstats.Stats(profile).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    prefixes = sorted((os.path.join(p, "") for p in sys.path if p), key=len, reverse=True)

    def where(file, line, name):
        file = next((file[len(p):] for p in prefixes if file.startswith(p)), file)
        return f"{file}:{line}({name})" if line else name

    lines = [f"{'own us':>8} {'cum us':>8} {'runs':>6}  function (per call, {calls} calls)"]
    for key, (_, runs, own, cumulative, _) in sorted(stats.items(), key=lambda item: -item[1][2])[:top]:
        lines.append(f"{own / calls * 1e6:8.2f} {cumulative / calls * 1e6:8.2f} {runs / calls:6.1f}  {where(*key)}")
    return "\n".join(lines)


def _error_note(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:160]}" if lines else type(error).__name__


def run_host(shapes=tuple(HOST_SHAPES.values()), calls=HOST_CALLS, columns=tuple(HOST_COLUMNS), profile=False,
             device="cuda", report=print):
    """[HostCell] for every shape, pass and column (bf16, causal), as run_host_here times them, but
    each of HOST_PROCESS_GROUPS in a child process of its own where other columns are timed too, so
    that neither JAX's runtime nor torch.compile's workers run in the process that times the rest."""
    groups = [[c for c in group if c in columns] for group in HOST_PROCESS_GROUPS]
    groups = [group for group in groups if group]
    here = [c for c in columns if not any(c in group for group in groups)]
    if len(groups) + bool(here) < 2:
        return run_host_here(shapes, calls, columns, profile, device, report)
    cells = run_host_here(shapes, calls, here, profile, device, report) if here else []
    import multiprocessing
    for group in groups:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            group_cells = pool.apply(run_host_here, (shapes, calls, group, profile, device, _silent))
        for cell in group_cells:
            report(_host_line(cell))
        cells += group_cells
    shapes, order = list(shapes), {column: i for i, column in enumerate(columns)}
    return sorted(cells, key=lambda c: (shapes.index(c.shape), HOST_PASSES.index(c.pass_), order[c.column]))


def _silent(message):
    pass


def _host_line(cell):
    return (f"host {_shape_text(cell.shape)} {cell.pass_} {cell.column}: "
            + ("-" if math.isnan(cell.us) else f"{cell.us:.1f} us") + (f" ({cell.note})" if cell.note else ""))


def run_host_here(shapes, calls, columns, profile=False, device="cuda", report=print):
    """[HostCell] for every shape, pass and column, timed in this process. The columns of a shape and pass
    take turns, HOST_REPS rounds of `calls` calls each after every column's warm-up, in balanced
    orders (balanced_order), and each cell is the median of its rounds: the host's speed
    drifts over a run, and turns give every column the same. A column that fails in a cell (not installed, not
    supported here) gives a NaN cell with the reason. With `profile`, each cell's cProfile report
    is printed after its timing. `device` other than "cuda" only exercises the plumbing (the tests
    run it on the CPU)."""
    import torch
    if device == "cuda":
        _busy(HOST_SPIN_S, device)
    cells = []
    for shape in shapes:
        generator = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=generator)
                         for _ in range(4))
        for pass_ in HOST_PASSES:
            timed, failed = {}, {}  # column -> its HostCall; column -> why it could not run
            for column in columns:
                try:
                    call = HOST_COLUMNS[column][0](q, k, v, dout, pass_)
                    if call is not None:
                        _warm_up(call)
                        timed[column] = call
                except Exception as error:  # a column that cannot run is a "-" cell with its reason
                    failed[column] = _error_note(error)
            # A second warm-up of each, after all were made: a compiled column recompiles here
            # after the next one's torch._dynamo.reset().
            for column, call in list(timed.items()):
                try:
                    _warm_up(call)
                except Exception as error:
                    failed[column] = _error_note(error)
                    del timed[column]
            samples = {column: [] for column in timed}
            for round_ in range(HOST_REPS):
                for column in balanced_order(list(timed), round_):
                    try:
                        samples[column].append(_host_turn(timed[column], calls))
                    except Exception as error:
                        failed[column] = _error_note(error)
                        del timed[column]
            for column in columns:
                if column in timed:
                    call = timed[column]
                    us, note = float(numpy.median(samples[column])), call.caveat() if call.caveat else ""
                elif column in failed:
                    us, note = math.nan, failed[column]
                else:
                    continue
                cells.append(HostCell(shape, pass_, column, us, note))
                report(_host_line(cells[-1]))
                if profile and column in timed:
                    report(profile_host(timed[column], calls))
    return cells


def host_environment():
    """The device, the versions of torch, JAX and CuPy, and today's date, on one line."""
    import datetime
    import importlib
    import torch
    from . import __version__
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    versions = []
    for name in ("torch", "jax", "cupy"):
        try:
            versions.append(f"{name} {importlib.import_module(name).__version__}")
        except ImportError:
            versions.append(f"{name} missing")
    return f"{device}; {', '.join(versions)}, cupyflash {__version__}; {datetime.date.today().isoformat()}"


def write_host(cells, out_dir, environment, calls=HOST_CALLS):
    """host.csv (one row per cell) and host.md (rows shape x pass, a column per way of calling, the
    ratios of HOST_RATIOS; a "-" cell's reason in a footnote); returns the markdown."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "host.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["batch", "seqlen", "nheads", "headdim", "pass", "column", "us", "note"])
        writer.writerows([*c.shape, c.pass_, c.column, "" if math.isnan(c.us) else f"{c.us:.2f}", c.note]
                         for c in cells)
    by_key = {(c.shape, c.pass_, c.column): c for c in cells}
    columns = list(dict.fromkeys(c.column for c in cells))
    shapes = list(dict.fromkeys(c.shape for c in cells))
    notes = {}  # (column, note): footnote number

    def text(cell):
        if cell is None:
            return ""
        value = "-" if math.isnan(cell.us) else f"{cell.us:.1f}"
        if cell.note:
            value += f" ({notes.setdefault((cell.column, cell.note), len(notes) + 1)})"
        return value

    def ratio(shape, pass_, a, b):
        x, y = by_key.get((shape, pass_, a)), by_key.get((shape, pass_, b))
        return "" if x is None or y is None or math.isnan(x.us / y.us) else f"{x.us / y.us:.2f}"

    ratios = [(a, b) for a, b in HOST_RATIOS if a in columns and b in columns]
    lines = ["# Host time per call", "", environment, "",
             f"Microseconds per call (lower is better): the wall time of {calls} back-to-back calls after "
             f"{HOST_WARMUP} warm-up calls (which take any torch.compile or jax.jit compilation), synchronised "
             f"once at the end, divided by {calls}; the columns take turns in balanced orders (the "
             "torch.compile columns and the JAX columns each in a process of their own), and a "
             f"cell is the median of its {HOST_REPS} turns. bf16, causal; shapes "
             "are batch x seqlen x nheads x headdim; fwd+bwd is the forward, then the gradients of q, k and v for "
             "a fixed dout. Where a call's GPU work takes longer than its host work (the large shape), the "
             "figure is the GPU's time.", "",
             f"Targets: {HOST_TARGETS}.", "",
             "| shape | pass | " + " | ".join(columns + [f"{a} / {b}" for a, b in ratios]) + " |",
             "|" + "---|" * (2 + len(columns) + len(ratios))]
    for shape in shapes:
        for pass_ in HOST_PASSES:
            if not any((shape, pass_, c) in by_key for c in columns):
                continue
            lines.append(f"| {_shape_text(shape)} | {pass_} | "
                         + " | ".join([text(by_key.get((shape, pass_, c))) for c in columns]
                                      + [ratio(shape, pass_, a, b) for a, b in ratios]) + " |")
    lines += ["", "Columns:"]
    lines += [f"- {c}: {HOST_COLUMNS[c][1] if c in HOST_COLUMNS else ''}" for c in columns]
    if notes:
        lines += [""] + [f"({number}) {column}: {note}" for (column, note), number in notes.items()]
    markdown = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "host.md"), "w") as f:
        f.write(markdown)
    return markdown


# ----------------------------------------------------------------------------------------- output

def _fmt(x):
    return "" if math.isnan(x) else f"{x:.1f}"


def write_speed(rows, out_dir, impls):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "speed.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["impl", "dtype", "headdim", "seqlen", "causal", "pass", "ms", "tflops"])
        for r in rows:
            writer.writerow([r.impl, r.dtype, r.headdim, r.seqlen, r.causal, r.pass_, f"{r.ms:.4f}", f"{r.tflops:.2f}"])
    by_key = {(r.impl, r.dtype, r.headdim, r.seqlen, r.causal, r.pass_): r.tflops for r in rows}
    keys = sorted({(r.pass_, r.dtype, r.headdim, r.seqlen, r.causal) for r in rows},
                  key=lambda k: (PASSES.index(k[0]), k[1], k[2], k[4], k[3]))
    lines = ["TFLOP/s (higher is better); vs best = cupyflash / the fastest peer of the cell (the ratio that "
             "matters), vs FA2 = cupyflash / " + REFERENCE_PEER + ".", "",
             "| pass | dtype | hdim | seqlen | causal | " + " | ".join(impls) + " | best peer | vs best | vs FA2 |",
             "|" + "---|" * (8 + len(impls))]
    for pass_, dtype, hd, seqlen, causal in keys:
        values = {i: by_key.get((i, dtype, hd, seqlen, causal, pass_), math.nan) for i in impls}
        ours = values.get("cupyflash", math.nan)
        peers = {i: x for i, x in values.items() if i != "cupyflash" and not math.isnan(x)}
        best = max(peers, key=peers.get) if peers else ""
        vs_best = ours / peers[best] if best else math.nan
        vs_fa2 = ours / values.get(REFERENCE_PEER, math.nan)
        lines.append(f"| {pass_} | {dtype} | {hd} | {seqlen} | {'yes' if causal else 'no'} | "
                     + " | ".join(_fmt(values[i]) for i in impls) + f" | {best} | "
                     + " | ".join('' if math.isnan(r) else f'{r:.2f}' for r in (vs_best, vs_fa2)) + " |")
    with open(os.path.join(out_dir, "speed.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot_speed(rows, impls, os.path.join(out_dir, "speed.png"))
    return "\n".join(lines)


def _pyplot():
    """matplotlib.pyplot drawing to files, or None where matplotlib is not installed (no plots then)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plot_speed(rows, impls, path):
    plt = _pyplot()
    if plt is None:
        return
    for dtype in sorted({r.dtype for r in rows}):
        panels = sorted({(r.headdim, r.causal, r.pass_) for r in rows if r.dtype == dtype},
                        key=lambda p: (PASSES.index(p[2]), p[1], p[0]))
        cols = len({(p[0]) for p in panels})
        nrows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
        for ax, (hd, causal, pass_) in zip(axes.flat, panels):
            for impl in impls:
                points = sorted((r.seqlen, r.tflops) for r in rows if (r.impl, r.dtype, r.headdim, r.causal, r.pass_)
                                == (impl, dtype, hd, causal, pass_) and not math.isnan(r.tflops))
                if points:
                    ax.plot(*zip(*points), marker="o", label=impl, linewidth=2.5 if impl == "cupyflash" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{pass_} hdim {hd}{' causal' if causal else ''}", fontsize=9)
            ax.set_xlabel("seqlen", fontsize=8)
            ax.set_ylabel("TFLOP/s", fontsize=8)
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"{dtype}, {TOKENS} tokens, hidden {HIDDEN}")
        fig.tight_layout(rect=(0, 0, 1, 0.97))
        fig.savefig(path.replace(".png", f"-{dtype}.png"), dpi=110)
        plt.close(fig)


def write_memory(results, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    names = list(dict.fromkeys(n for _, n, _ in results))
    seqlens = sorted({s for s, _, _ in results})
    table = {(s, n): m for s, n, m in results}
    lines = ["Peak device memory of one causal fwd+bwd beyond the inputs, MiB (batch 1, 16 heads, hdim 128, bf16); "
             "blank = failed (out of memory).", "",
             "| seqlen | " + " | ".join(names) + " |", "|" + "---|" * (1 + len(names))]
    lines += [f"| {s} | " + " | ".join(_fmt(table[s, n]) for n in names) + " |" for s in seqlens]
    with open(os.path.join(out_dir, "memory.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "memory.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seqlen", "impl", "extra_mib"])
        writer.writerows(results)
    plt = _pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for n in names:
            points = [(s, table[s, n]) for s in seqlens if not math.isnan(table[s, n])]
            if points:
                ax.plot(*zip(*points), marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("extra MiB")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "memory.png"), dpi=110)
        plt.close(fig)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ decode
# Decode steps (`bench --decode`): seqlen_q query tokens per sequence over a cache of `cache` keys
# and values already written, bf16, not causal (a step's queries see the whole cache). A step's cost
# is its read of the cache, so the figure is TB/s of K and V read (bytes / time), beside the
# device's copy bandwidth. Every implementation reads the same logical cache: cupyflash's
# flash_attn_with_kvcache in its own layout (dense, or paged through a shuffled block table), the
# peers SDPA's dense (batch, nheads_k, cache, headdim) layout in every cell (they have no paged
# cache). Each peer's output is first compared with cupyflash's where cupyflash runs. (On the CPU
# the tests run the plumbing: cupyflash.torch there is the NumPy reference.)

DECODE_GRID = dict(batches=(1, 4, 16, 64, 128), caches=(1024, 4096, 16384, 65536, 131072),
                   heads=((32, 8), (8, 1), (32, 32)), headdims=(64, 128), seqlens_q=(1, 4),
                   layouts=("dense", "paged16", "paged256"))
DECODE_MAX_BYTES = 24 << 30  # K and V of a cell (each implementation holds its own copy); larger cells are left out
COPY_BYTES = 2 << 30  # the copy that measure_copy_tbps times: far past the L2


def measure_copy_tbps(nbytes=COPY_BYTES, reps=11):
    """This GPU's device-to-device copy rate, TB/s of bytes read and written (as
    ../shared/peers/README.md counts it: 4.24 on the H200, about 3.0 on an H100), timed as every
    call is (time_ms). The decode table's fractions are of it."""
    import torch
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * nbytes / (time_ms(lambda: target.copy_(source), reps=reps) * 1e-3) / 1e12


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    batch: int
    cache: int
    nheads: int
    nheads_k: int
    headdim: int
    seqlen_q: int
    layout: str  # "dense" or "paged<page size>"

    @property
    def kv_bytes(self):
        return 2 * self.batch * self.cache * self.nheads_k * self.headdim * 2

    @property
    def page(self):
        return int(self.layout[5:]) if self.layout.startswith("paged") else 0


@dataclasses.dataclass
class DecodeCell:
    shape: DecodeShape
    impl: str
    ms: float   # NaN where the implementation failed, disagreed or is missing
    note: str = ""

    @property
    def tbps(self):
        return self.shape.kv_bytes / (self.ms * 1e-3) / 1e12


def decode_shapes(grid=DECODE_GRID, max_bytes=DECODE_MAX_BYTES):
    """Every cell of the grid whose K and V fit in max_bytes, in grid order."""
    shapes = []
    for (nheads, nheads_k), headdim, seqlen_q, layout, batch, cache in itertools.product(
            grid["heads"], grid["headdims"], grid["seqlens_q"], grid["layouts"], grid["batches"], grid["caches"]):
        shape = DecodeShape(batch, cache, nheads, nheads_k, headdim, seqlen_q, layout)
        if shape.kv_bytes <= max_bytes:
            shapes.append(shape)
    return shapes


def _decode_cupyflash(shape, q, k, v, generator):
    """cupyflash.torch's flash_attn_with_kvcache: the cache in cupyflash's layout, dense or paged."""
    import torch
    from .torch import flash_attn_with_kvcache
    from .validate import no_host_sync
    k_cache, v_cache = (x.transpose(1, 2).contiguous() for x in (k, v))  # (batch, cache, nheads_k, headdim)
    table = None
    if shape.page:
        pages = shape.cache // shape.page
        table = torch.randperm(shape.batch * pages, generator=generator, device=q.device).view(shape.batch, pages).int()
        paged = [torch.empty((shape.batch * pages, shape.page) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
                 for x in (k_cache, v_cache)]
        for store, dense in zip(paged, (k_cache, v_cache)):
            store[table.flatten().long()] = dense.reshape(shape.batch * pages, shape.page, *dense.shape[2:])
        k_cache, v_cache = paged
    seqlens = torch.full((shape.batch,), shape.cache, dtype=torch.int32, device=q.device)

    def step():  # without the host's check of the lengths and the block table, as a serving loop runs
        with no_host_sync():
            return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    return step


def _decode_sdpa(backend_name):
    def make(shape, q, k, v, generator):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = getattr(SDPBackend, backend_name)
        qt = q.transpose(1, 2)  # (batch, nheads, seqlen_q, headdim)

        def step():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, k, v, enable_gqa=True).transpose(1, 2)
        return step
    return make


DECODE_IMPLEMENTATIONS = {
    "cupyflash": _decode_cupyflash,
    "SDPA flash (FA2)": _decode_sdpa("FLASH_ATTENTION"),
    "SDPA cuDNN": _decode_sdpa("CUDNN_ATTENTION"),
}


def run_decode(shapes, impls=tuple(DECODE_IMPLEMENTATIONS), device="cuda", reps=5, report=print):
    """[DecodeCell] of every shape and implementation, timed in turns (median_ms) as replays of a
    CUDA graph of back-to-back steps (GraphTimer: a small cache's step takes a few microseconds of
    GPU time, less than an eager call's host time, so eager timing would measure the host); `device`
    other than "cuda" runs each call once, untimed (the tests' plumbing check on the CPU). Ctrl-C
    (or SIGINT from a time limit) ends the run early with the shapes done so far: a whole grid takes
    minutes, and what was measured is worth writing."""
    cells = []
    try:
        for shape in shapes:
            cells += _decode_shape(shape, impls, device, reps, report)
    except KeyboardInterrupt:
        report(f"decode: interrupted after {len(cells) // max(1, len(impls))} of {len(shapes)} shapes")
    return cells


def decode_inputs(shape, device):
    """(generator, q, k, v) of a decode cell, bf16, drawn on `device` (a 128k cache drawn on the host
    took seconds per cell): q (batch, seqlen_q, nheads, headdim), k and v in SDPA's layout (batch,
    nheads_k, cache, headdim); each implementation's step (DECODE_IMPLEMENTATIONS) takes them."""
    import torch
    generator = torch.Generator(device=device).manual_seed(shape.batch * 7 + shape.cache)
    draw = lambda *size: torch.randn(*size, generator=generator, device=device, dtype=torch.bfloat16)  # noqa: E731
    q = draw(shape.batch, shape.seqlen_q, shape.nheads, shape.headdim)
    k, v = (draw(shape.batch, shape.nheads_k, shape.cache, shape.headdim) for _ in range(2))
    return generator, q, k, v


def _decode_shape(shape, impls, device, reps, report):
    """run_decode's cells of one shape."""
    cells = []
    generator, q, k, v = decode_inputs(shape, device)
    steps, notes, expected = {}, {}, None
    for impl in impls:
        try:
            step = DECODE_IMPLEMENTATIONS[impl](shape, q, k, v, generator)
            out = step()
            if impl == "cupyflash":
                expected = out
            elif expected is not None and not _agrees(out, expected):
                raise ValueError("its output disagrees with cupyflash's")
            steps[impl] = step
        except Exception as error:  # a missing or failing implementation gives a blank cell with its reason
            notes[impl] = _error_note(error)
    if device == "cuda":
        timers = {}
        for impl, step in steps.items():
            try:
                timers[impl] = GraphTimer(step)
            except Exception as error:  # a step that cannot be captured gives a blank cell with its reason
                notes[impl] = _error_note(error)
        times = median_ms(timers, reps, report)
    else:
        times = {impl: math.nan for impl in steps}
    for impl in impls:
        cell = DecodeCell(shape, impl, times.get(impl, math.nan), notes.get(impl, ""))
        cells.append(cell)
        report(f"decode {_decode_label(shape)} {impl}: "
               + (f"{cell.tbps:.2f} TB/s" if not math.isnan(cell.ms) else f"- ({cell.note})" if cell.note else "-"))
    return cells


def _agrees(got, want):
    """Whether torch tensor `got` is finite and within 5% of `want`'s largest magnitude of it: far
    beyond the 16-bit rounding two correct kernels differ by."""
    got, want = got.float(), want.float()
    return bool(got.isfinite().all()) and (got - want).abs().max().item() <= 0.05 * want.abs().max().item() + 1e-3


def run_profiled(call, device="cuda"):
    """Runs `call` once between cudaProfilerStart and Stop, the GPU idle on both sides, so that
    `ncu --profile-from-start off` measures exactly its kernels (bench/attn_profile.py,
    bench/decode_profile.py); on another device it only runs it (their CPU tests)."""
    import torch
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    call()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def _decode_label(shape):
    return (f"b{shape.batch} cache{shape.cache} h{shape.nheads}/{shape.nheads_k} d{shape.headdim} "
            f"sq{shape.seqlen_q} {shape.layout}")


def write_decode(cells, out_dir, environment, copy_tbps):
    """decode.csv (a row per cell), decode.md (a row per shape: TB/s of each implementation, the
    ratio to the best peer and the fraction of `copy_tbps`, the GPU's copy rate; blank cells'
    reasons as footnotes) and decode.png (TB/s against the cache length); returns the markdown."""
    os.makedirs(out_dir, exist_ok=True)
    impls = list(dict.fromkeys(c.impl for c in cells))
    with open(os.path.join(out_dir, "decode.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["batch", "cache", "nheads", "nheads_k", "headdim", "seqlen_q", "layout", "impl", "ms",
                         "tbps", "note"])
        for c in cells:
            s = c.shape
            writer.writerow([s.batch, s.cache, s.nheads, s.nheads_k, s.headdim, s.seqlen_q, s.layout, c.impl,
                             f"{c.ms:.5f}", f"{c.tbps:.3f}", c.note])
    by_shape = {}
    for c in cells:
        by_shape.setdefault(c.shape, {})[c.impl] = c
    notes = {}
    lines = ["# Decode: TB/s of K and V read per step", "", environment, "",
             "bf16, not causal, the cache full (cache_seqlens = cache); peers read a dense copy of the same cache. "
             "Every implementation is timed as replays of a CUDA graph of back-to-back decode steps, as a serving "
             "loop runs them (GraphTimer); cupyflash.torch's calls run under no_host_sync (lengths and block "
             f"table not read on the host). Copy bandwidth: {copy_tbps:.2f} TB/s.", "",
             "| batch | cache | heads | hdim | seqlen_q | layout | " + " | ".join(impls)
             + " | cupyflash / best peer | cupyflash / copy |", "|" + "---|" * (8 + len(impls))]
    for shape, row in by_shape.items():
        texts = []
        for impl in impls:
            cell = row.get(impl)
            if cell is None or math.isnan(cell.ms):
                note = cell.note if cell is not None else ""
                texts.append("-" if not note else f"- ({notes.setdefault(f'{impl}: {note}', len(notes) + 1)})")
            else:
                texts.append(f"{cell.tbps:.2f}")
        ours = row.get("cupyflash")
        peers = [c.tbps for impl, c in row.items() if impl != "cupyflash" and not math.isnan(c.ms)]
        ratio = ours.tbps / max(peers) if ours is not None and not math.isnan(ours.ms) and peers else math.nan
        fraction = ours.tbps / copy_tbps if ours is not None and not math.isnan(ours.ms) else math.nan
        lines.append(f"| {shape.batch} | {shape.cache} | {shape.nheads}/{shape.nheads_k} | {shape.headdim} | "
                     f"{shape.seqlen_q} | {shape.layout} | " + " | ".join(texts) + f" | {_ratio(ratio)} | {_ratio(fraction)} |")
    if notes:
        lines += [""] + [f"({number}) {text}" for text, number in notes.items()]
    markdown = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "decode.md"), "w") as f:
        f.write(markdown)
    _plot_decode(cells, impls, os.path.join(out_dir, "decode.png"), copy_tbps)
    return markdown


def _ratio(x):
    return "" if math.isnan(x) else f"{x:.2f}"


def _plot_decode(cells, impls, path, copy_tbps):
    """TB/s against the cache length, one panel per head layout and head dim (seqlen_q 1, dense,
    batch 16 where the grid has it)."""
    plt = _pyplot()
    if plt is None:
        return
    chosen = [c for c in cells if c.shape.seqlen_q == 1 and c.shape.layout == "dense" and not math.isnan(c.ms)]
    batch = 16 if any(c.shape.batch == 16 for c in chosen) else min((c.shape.batch for c in chosen), default=0)
    panels = sorted({(c.shape.nheads, c.shape.nheads_k, c.shape.headdim) for c in chosen})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (nheads, nheads_k, headdim) in zip(axes[0], panels):
        for impl in impls:
            points = sorted((c.shape.cache, c.tbps) for c in chosen if c.impl == impl and c.shape.batch == batch
                            and (c.shape.nheads, c.shape.nheads_k, c.shape.headdim) == (nheads, nheads_k, headdim))
            if points:
                ax.plot(*zip(*points), marker="o", label=impl)
        ax.axhline(copy_tbps, color="gray", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"h {nheads}/{nheads_k}, d {headdim}, batch {batch}", fontsize=9)
        ax.set_xlabel("cache length")
        ax.set_ylabel("TB/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
