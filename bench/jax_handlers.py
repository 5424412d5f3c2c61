"""Host time per call of cupyflash.jax's custom calls on the GPU: XLA's typed FFI through ctypes
(cupyflash/_xla_ffi.py, what cupyflash.jax registers) against jax.experimental.buffer_callback,
and cupyflash.jax fwd+bwd against JAX's cuDNN attention. bench/notes/jax-handlers.md reads it.

Usage: python bench/jax_handlers.py [--calls 200] [--repeats 5] [--profile] [--copies]

Each row is us per call, the median of `repeats` runs of `calls` back-to-back calls of one jitted
function on the same arrays: "host" times the loop of dispatches alone (JAX returns before the GPU
is done, so this is the host's cost), "wall" also waits for the last result (the larger of host
and GPU time).

  mechanism rows, at q = k = v (1, 128, 8, 64) bf16 with the forward's two results:
    plain XLA                  q * 2: JAX's dispatch with no custom call
    FFI / buffer_callback: return at once
                               the mechanism's own cost: XLA reaching Python and back
    FFI / buffer_callback: read the call
                               plus what a handler reads every call: the stream and the buffers'
                               addresses (and, for the FFI, the signature attribute)
    forward, FFI               cupyflash.jax.forward_with_lse (causal)
    forward, buffer_callback   the same cached plan run from a buffer_callback
  fwd+bwd rows, at (1, 128, 8, 64) and (4, 512, 16, 128) bf16 causal: out and the vjp's dq, dk, dv
    in one jitted function, cupyflash.jax.flash_attn and jax.nn.dot_product_attention(implementation
    "cudnn"), and their ratio (the issue's bar: at most 1.2).

--profile prints cProfile's top entries for cupyflash.jax fwd+bwd at the small shape (the
handlers' Python). --copies checks that the jitted fwd+bwd copies nothing: no copy instruction in
XLA's compiled program, and no copy issued by the handlers (cupyflash.jax._copy, their one copy).
"""

import argparse
import functools
import math
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMALL, LARGE = (1, 128, 8, 64), (4, 512, 16, 128)


def per_call_us(fn, args, calls, repeats):
    """(host, wall) us per call: medians over `repeats` runs of `calls` back-to-back calls."""
    import jax
    for _ in range(3):  # compile, build the plan, warm the allocators
        jax.block_until_ready(fn(*args))
    host, wall = [], []
    for _ in range(repeats):
        begin = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        dispatched = time.perf_counter()
        jax.block_until_ready(result)
        end = time.perf_counter()
        host.append((dispatched - begin) / calls * 1e6)
        wall.append((end - begin) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)


def inputs(shape, count=4):
    import jax
    import jax.numpy as jnp
    keys = jax.random.split(jax.random.PRNGKey(0), count)
    return [jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key in keys]


def _results(q):
    import jax
    import jax.numpy as jnp
    batch, seqlen, nheads, _ = q.shape
    return (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, nheads, seqlen), jnp.float32))


# --- the FFI: targets registered through cupyflash._xla_ffi, as cupyflash.jax's are ----------

@functools.cache
def _ffi_targets():
    import jax
    from cupyflash import _xla_ffi, jax as cfjax

    def read(call):
        call.first_scalar(b"_signature")
        cfjax._device(call)
        call.arg_pointers()
        call.ret_pointers()
        call.cuda_stream()

    targets = {"return": lambda call: None, "read": read}
    for name, handler in targets.items():
        jax.ffi.register_ffi_target(f"cupyflash_bench_{name}", _xla_ffi.handler_capsule(handler), platform="CUDA")
    return tuple(targets)


def ffi_call(what):
    import jax
    import numpy
    _ffi_targets()

    def call(q, k, v):
        return jax.ffi.ffi_call(f"cupyflash_bench_{what}", _results(q))(q, k, v, _signature=numpy.int64(1),
                                                                           causal=numpy.bool_(True))
    return call


# --- buffer_callback -------------------------------------------------------------------------

def _address(buffer):
    return buffer.__cuda_array_interface__["data"][0]


def buffer_callback_call(what):
    from jax.experimental.buffer_callback import buffer_callback
    from cupyflash import jax as cfjax

    def read(ctx, outs, *args):
        ctx.stream
        0 if cfjax._one_device() else args[0].__dlpack_device__()[1]
        [_address(b) for b in args]
        [_address(b) for b in outs]

    callback = {"return": lambda ctx, outs, *args: None, "read": read}[what]
    return lambda q, k, v: buffer_callback(callback, _results(q))(q, k, v)


def buffer_callback_forward(q, k, v):
    """cupyflash's causal forward from a buffer_callback: the closure holds the call's static
    part (here: causal, the shapes fixed by the trace), so the plan is kept per device alone."""
    import cupy
    from jax.experimental.buffer_callback import buffer_callback
    from cupyflash import api, validate, jax as cfjax
    plans = {}

    def view(buffer, device):
        nbytes = buffer.dtype.itemsize * math.prod(buffer.shape)
        memory = cupy.cuda.UnownedMemory(_address(buffer), nbytes, None, device)
        return cupy.ndarray(buffer.shape, buffer.dtype, cupy.cuda.MemoryPointer(memory, 0))

    def callback(ctx, outs, q, k, v):
        stream = ctx.stream
        device = 0 if cfjax._one_device() else q.__dlpack_device__()[1]
        plan = plans.get(device)
        if plan is None:
            with cupy.cuda.Device(device), cfjax._external_stream(stream, device), validate.no_host_sync():
                views = {"q": view(q, device), "k": view(k, device), "v": view(v, device)}
                plan = plans[device] = api.plan_of("fwd", views, None, True, {}, "bench")
        plan.run({"q": _address(q), "k": _address(k), "v": _address(v)}, None,
                 {"out": _address(outs[0]), "lse": _address(outs[1])}, stream)

    return buffer_callback(callback, _results(q))(q, k, v)


# --- fwd+bwd ---------------------------------------------------------------------------------

def fwd_bwd(attention):
    import jax

    def step(q, k, v, dout):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(dout)
    return jax.jit(step)


def ours(q, k, v):
    from cupyflash.jax import flash_attn
    return flash_attn(q, k, v, causal=True)


def cudnn(q, k, v):
    import jax
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--copies", action="store_true")
    args = parser.parse_args()

    import cupy
    import jax
    import jaxlib
    from cupyflash.jax import forward_with_lse
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, cupy {cupy.__version__}, "
          f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; {args.calls} calls, median of {args.repeats}")

    def row(name, fn, arrays):
        host, wall = per_call_us(fn, arrays, args.calls, args.repeats)
        print(f"{name:44s} host {host:8.1f}  wall {wall:8.1f} us/call", flush=True)
        return host, wall

    q, k, v, dout = inputs(SMALL)
    print("--- mechanisms, (1, 128, 8, 64) bf16")
    row("plain XLA (q * 2)", jax.jit(lambda q, k, v: q * 2), (q, k, v))
    for what, label in (("return", "return at once"), ("read", "read the call")):
        row(f"FFI: {label}", jax.jit(ffi_call(what)), (q, k, v))
        row(f"buffer_callback: {label}", jax.jit(buffer_callback_call(what)), (q, k, v))
    row("forward, FFI (cupyflash.jax)", jax.jit(functools.partial(forward_with_lse, causal=True)), (q, k, v))
    row("forward, buffer_callback", jax.jit(buffer_callback_forward), (q, k, v))
    ffi_out = jax.jit(functools.partial(forward_with_lse, causal=True))(q, k, v)
    callback_out = jax.jit(buffer_callback_forward)(q, k, v)
    print(f"  the two forwards agree bit for bit: {all(bool((a == b).all()) for a, b in zip(ffi_out, callback_out))}")

    print("--- fwd+bwd, bf16 causal")
    for shape in (SMALL, LARGE):
        arrays = inputs(shape)
        mine = row(f"cupyflash.jax {shape}", fwd_bwd(ours), arrays)
        theirs = row(f"JAX cuDNN {shape}", fwd_bwd(cudnn), arrays)
        print(f"  ratio cupyflash / cuDNN: host {mine[0] / theirs[0]:.2f}, wall {mine[1] / theirs[1]:.2f}")

    if args.profile:
        import cProfile
        import pstats
        step, arrays = fwd_bwd(ours), inputs(SMALL)
        jax.block_until_ready(step(*arrays))
        profile = cProfile.Profile()
        profile.runcall(lambda: jax.block_until_ready([step(*arrays) for _ in range(args.calls)]))
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)

    if args.copies:
        check_copies(fwd_bwd(ours), inputs(SMALL))


def check_copies(step, arrays):
    """Prints the copy instructions of the compiled program and the copies the handlers issue."""
    import re
    import jax
    from cupyflash import jax as cfjax
    hlo = step.lower(*arrays).compile().as_text()
    instructions = re.findall(r"= \S+ (copy(?:-start|-done)?)\(", hlo)
    print(f"copy instructions in the compiled fwd+bwd: {len(instructions)}")
    issued = []
    original = cfjax._copy
    cfjax._copy = lambda *a: (issued.append(a), original(*a))
    try:
        jax.block_until_ready([step(*arrays) for _ in range(10)])
    finally:
        cfjax._copy = original
    print(f"copies issued by the handlers in 10 calls: {len(issued)}")


if __name__ == "__main__":
    main()
