"""Where an eager forward's host time goes (issue 18): the whole calls (SDPA flash, cupyflash.torch
with and without grad, the core on torch and CuPy arrays) beside their parts timed alone (the
signature lookup, the plan's call, its allocations, stream read and launch, an autograd.Function
that launches nothing, with and without its saves). us per call: 2000 back-to-back calls per
timing, median of 7 timings, synchronised after each. --backward: the same for a forward and
backward (backward_parts()).

Usage (GPU): PYTHONPATH=. python bench/host_parts.py [--with-jax] [--turns | --backward | --profile-backward]
[b s h d ...]
(default 1 128 8 64, bf16 causal). --with-jax first runs a jitted JAX function on the GPU, as `bench
--host` has before its torch columns (v42: that table reads every cell 1.3-1.6x these figures): its
runtime's threads stay. --turns times whole calls instead in turns like the table's (turns()).
"""
import statistics
import sys
import time

import cupy
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupyflash
import cupyflash.torch as cft
from cupyflash import _plan

CALLS, TIMINGS = 2000, 7


def per_call_us(function):
    for _ in range(200):
        function()
    torch.cuda.synchronize()
    times = []
    for _ in range(TIMINGS):
        start = time.perf_counter()
        for _ in range(CALLS):
            function()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(times)


class Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        return dout, dout, dout


class EmptySaved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, resolved, seed, lse_out, alibi, q, k, v, bias):
        out = torch.empty_like(q)
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        lse_out.append(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.resolved, ctx.seed = resolved, seed
        return out

    @staticmethod
    def backward(ctx, dout):
        return None, None, None, None, dout, dout, dout, None


class OurForwardOnly(torch.autograd.Function):
    """The drop-in's Function (_ResolvedFunction) with its forward and an empty backward."""
    forward = staticmethod(cft._ResolvedFunction.forward)

    @staticmethod
    def backward(ctx, dout):
        return None, None, None, None, dout, dout, dout, None


class OurBackwardOnly(EmptySaved):
    """EmptySaved's forward (the saves and allocations, no launch) with the drop-in's backward."""
    @staticmethod
    def backward(ctx, dout):
        return cft._ResolvedFunction.backward(ctx, dout)


class FloorRunning(EmptySaved):
    """EmptySaved whose backward first runs its `resolved` argument, a function of no arguments: a
    part of our backward timed on autograd's thread, where the drop-in's backward runs."""
    @staticmethod
    def backward(ctx, dout):
        ctx.resolved()
        return None, None, None, None, dout, dout, dout, None


def launches_alone(plan):
    """A function that queues `plan`'s kernels as its call does (Plan.call's loop), with nothing else."""
    stream, launch = plan.stream_of(), plan.launch_kernel

    def launch_only():
        for function, (gx, gy, gz), threads, smem, argv, extended in plan.launches:
            if extended is None:
                launch(function, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
            else:
                extended(stream)
    return launch_only


def tensors(b, s, h, d):
    """q, k, v (bf16, (b, s, h, d)); the same requiring grad; SDPA's (b, h, s, d) views requiring
    grad; CuPy views of q, k, v."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    grad = tuple(t.clone().requires_grad_() for t in (q, k, v))
    sdpa = tuple(t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    return (q, k, v), grad, sdpa, tuple(cupy.from_dlpack(t) for t in (q, k, v))


def parts(b, s, h, d):
    (q, k, v), (qg, kg, vg), (qt, kt, vt), (qc, kc, vc) = tensors(b, s, h, d)
    scalars = (None, True, 0.0, (-1, -1), 0.0, False)
    resolved = cft._resolution(q, k, v, None, None, scalars)
    plan = resolved.plan
    inputs = [(q, k, v, None, None)[i] for i in resolved.forward_positions]
    bare_empty, bare_saved = cft._bare_apply(Empty), cft._bare_apply(EmptySaved)
    lse_shape = (b, h, s)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        rows = {
            "SDPA flash fwd (grad)": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
            "SDPA flash fwd (no grad)": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                               v.transpose(1, 2), is_causal=True),
            "cupyflash.torch fwd (grad)": lambda: cft.flash_attn_func(qg, kg, vg, causal=True),
            "cupyflash.torch fwd (no grad)": lambda: cft.flash_attn_func(q, k, v, causal=True),
            "core fwd (torch)": lambda: cupyflash.flash_attn_func(q, k, v, causal=True),
            "core fwd (CuPy)": lambda: cupyflash.flash_attn_func(qc, kc, vc, causal=True),
            "  _resolution (signature lookup)": lambda: cft._resolution(q, k, v, None, None, scalars),
            "  _needs_grad + _eager": lambda: (cft._needs_grad(qg, kg, vg, None), cft._eager(qg, kg, vg, None, None)),
            "  plan.call (torch)": lambda: plan.call(inputs, None, keep=True),
            "  torch.empty_like + new_empty": lambda: (torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)),
            "  stream read": plan.stream_of,
            "  data_ptr x5": lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.data_ptr(), k.data_ptr()),
            "  launchKernel alone": launches_alone(plan),
            "  Function.apply, empty forward": lambda: Empty.apply(qg, kg, vg),
            "  bare apply, empty forward": lambda: bare_empty(qg, kg, vg),
            "  bare apply, saves as ours": lambda: bare_saved(resolved, None, [], None, qg, kg, vg, None),
            "  torch.is_grad_enabled": torch.is_grad_enabled,
            "  core plan_key (CuPy)": lambda: _plan.plan_key("fwd", dict(q=qc, k=kc, v=vc), None, True, {}, None),
        }
        return {name: per_call_us(function) for name, function in rows.items()}


def backward_parts(b, s, h, d):
    """A fwd+bwd's host time by its parts (issue 18's eager fwd+bwd: 1.28-1.44x SDPA's in v55, against
    a bare Function's floor that leaves 20-30 us too few for our backward): whole fwd+bwd calls, then
    the drop-in's backward below autograd (the resolved signature's backward, its plan's call, the
    launches, the allocations) and the core's backward; the floor's Function with our forward, then
    with our backward, and with parts of our backward (each run on autograd's thread, where the
    rows after them run on this one: v56 read our backward 94 us dearer there at the small shape),
    and whole calls with autograd's multithreading off (the backward on this thread). A row that
    reads the same at a larger shape is host-bound."""
    (q, k, v), (qg, kg, vg), (qt, kt, vt), (qc, kc, vc) = tensors(b, s, h, d)
    dout = torch.randn_like(q)
    scalars = (None, True, 0.0, (-1, -1), 0.0, False)
    resolved = cft._resolution(q, k, v, None, None, scalars)
    out, lse = resolved.forward(q, k, v, None, None, None)
    resolved.backward(dout, q, k, v, out, lse, None, None, None, False)  # makes its plan
    (plan, positions), = resolved.backward_plans.values()
    given = (dout, q, k, v, out, lse, None, None)
    inputs = [given[i] for i in positions]
    outc, lsec = cupyflash.flash_attn_func(qc, kc, vc, causal=True, return_lse=True)
    doutc = cupy.from_dlpack(dout)
    floor = cft._bare_apply(EmptySaved)
    forward_only, backward_only = cft._bare_apply(OurForwardOnly), cft._bare_apply(OurBackwardOnly)
    running = cft._bare_apply(FloorRunning)

    def on_autograd_thread(work):
        return lambda: torch.autograd.grad(running(work, None, [], None, qg, kg, vg, None), (qg, kg, vg), dout)

    def on_this_thread(call):  # the backward on the calling thread, not the device's autograd thread
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                return call()
        return run

    dout_t = dout.transpose(1, 2)  # SDPA's (b, h, s, d) layout
    whole = {  # fwd+bwd calls, timed as called and with the backward on this thread
        "SDPA flash fwd+bwd": lambda: torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
                                                          (qt, kt, vt), dout_t),
        "cupyflash.torch fwd+bwd": lambda: torch.autograd.grad(cft.flash_attn_func(qg, kg, vg, causal=True),
                                                               (qg, kg, vg), dout),
        "Function floor fwd+bwd": lambda: torch.autograd.grad(floor(resolved, None, [], None, qg, kg, vg, None),
                                                              (qg, kg, vg), dout),
    }
    backward = {  # parts of our backward, timed on autograd's thread and on this one
        "resolved.backward": lambda: resolved.backward(dout, q, k, v, out, lse, None, None, None, False),
        "backward plan.call": lambda: plan.call(inputs, None, keep=True),
        "backward launches alone": launches_alone(plan),
        "torch.empty_like x3": lambda: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)),
    }
    rows = dict(whole)
    rows["  floor + our forward"] = lambda: torch.autograd.grad(
        forward_only(resolved, None, [], None, qg, kg, vg, None), (qg, kg, vg), dout)
    rows["  floor + our backward"] = lambda: torch.autograd.grad(
        backward_only(resolved, None, [], None, qg, kg, vg, None), (qg, kg, vg), dout)
    rows.update({f"{name}, one thread": on_this_thread(call) for name, call in whole.items()})
    rows["  floor + nothing, on autograd's thread"] = on_autograd_thread(lambda: None)
    rows.update({f"  floor + {name}, there": on_autograd_thread(part) for name, part in backward.items()})
    rows.update({f"  {name}": part for name, part in backward.items()})
    rows["core bwd (torch)"] = lambda: cupyflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    rows["core bwd (CuPy)"] = lambda: cupyflash.flash_attn_backward(doutc, qc, kc, vc, outc, lsec, causal=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return {name: per_call_us(function) for name, function in rows.items()}


def turns(b, s, h, d):
    """Why `bench --host` reads some columns above these figures: a turn of 200 calls after the GPU
    idled (as the table's columns take turns) against 2000 calls on a busy GPU. For each: us per
    call to enqueue (the host's time), to finish (synchronised), and the GPU's own (events around
    the turn)."""
    _, (qg, kg, vg), (qt, kt, vt), (qc, kc, vc) = tensors(b, s, h, d)
    calls = {"core fwd (CuPy)": lambda: cupyflash.flash_attn_func(qc, kc, vc, causal=True),
             "cupyflash.torch fwd (grad)": lambda: cft.flash_attn_func(qg, kg, vg, causal=True),
             "SDPA flash fwd (grad)": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)}
    rows = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for name, function in calls.items():
            for _ in range(200):
                function()
            for count, idle_s in ((200, 0.02), (200, 0.0), (2000, 0.0)):
                samples = []
                for _ in range(TIMINGS):
                    torch.cuda.synchronize()
                    time.sleep(idle_s)
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin = time.perf_counter()
                    start.record()
                    for _ in range(count):
                        function()
                    stop.record()
                    enqueued = time.perf_counter()
                    cupy.cuda.Device().synchronize()
                    torch.cuda.synchronize()
                    finished = time.perf_counter()
                    samples.append(((enqueued - begin) / count * 1e6, (finished - begin) / count * 1e6,
                                    start.elapsed_time(stop) / count * 1e3))
                enqueue, total, gpu = (statistics.median(x) for x in zip(*samples))
                rows.append(f"{name:28s} {count:5d} calls, idle {idle_s * 1e3:4.0f} ms before: enqueue {enqueue:6.2f}"
                            f"  total {total:6.2f}  GPU {gpu:6.2f}")
    return rows


class ProfiledBackward(torch.autograd.Function):
    """The drop-in's Function whose backward runs under `ctx.resolved.profiler` (cProfile), on the
    thread autograd runs it on: what its functions cost there, by their own time."""
    forward = staticmethod(cft._ResolvedFunction.forward)

    @staticmethod
    def backward(ctx, dout):
        ctx.resolved.profiler.enable()
        try:
            return cft._ResolvedFunction.backward(ctx, dout)
        finally:
            ctx.resolved.profiler.disable()


def profile_backward(b, s, h, d, calls=2000):
    """The functions of the drop-in's backward on autograd's thread, by their own time over `calls`
    fwd+bwd calls (cProfile's cost included: compare the rows, not the totals)."""
    import cProfile
    import io
    import pstats
    _, (qg, kg, vg), _, _ = tensors(b, s, h, d)
    dout = torch.randn_like(qg)
    resolved = cft._resolution(qg.detach(), kg.detach(), vg.detach(), None, None, (None, True, 0.0, (-1, -1), 0.0, False))
    resolved.profiler = cProfile.Profile()
    apply = cft._bare_apply(ProfiledBackward)
    for _ in range(calls):
        torch.autograd.grad(apply(resolved, None, [], None, qg, kg, vg, None), (qg, kg, vg), dout)
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(resolved.profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def start_jax():
    import os
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp
    x = jnp.ones((256, 256), jnp.float32)
    jax.jit(lambda a: (a @ a).sum())(x).block_until_ready()


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if "--with-jax" in arguments:
        arguments.remove("--with-jax")
        start_jax()
    with_turns, with_backward, with_profile = ("--turns" in arguments, "--backward" in arguments,
                                               "--profile-backward" in arguments)
    arguments = [a for a in arguments if a not in ("--turns", "--backward", "--profile-backward")]
    numbers = [int(x) for x in arguments] or [1, 128, 8, 64]
    for shape in zip(*[iter(numbers)] * 4):
        print(f"shape {shape}, bf16 causal, us per call", flush=True)
        if with_turns:
            print("\n".join(turns(*shape)), flush=True)
            continue
        if with_profile:
            print(profile_backward(*shape), flush=True)
            continue
        for name, us in (backward_parts if with_backward else parts)(*shape).items():
            print(f"{name:40s} {us:7.2f}", flush=True)
