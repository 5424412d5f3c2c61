"""Does a change to the kernels leave their results bit for bit as they were? Run once per tree
(the tree first on PYTHONPATH), each writing the outputs and lse of the same seeded calls, and the
deterministic backward's dq, dk and dv, then compare (v74's patches only move waits, and dK's dS^T
operand from registers to the same values in shared memory: the same operations in the same order):

    PYTHONPATH=TREE python bench/notes/v74-same-bits.py write OUT.npz
    python bench/notes/v74-same-bits.py compare A.npz B.npz
"""
import sys

import numpy

SHAPES = [(hd, s, causal) for hd in (64, 128, 256) for s in (113, 1000, 4096) for causal in (False, True)]
OPTIONS = {"plain": {}, "softcap": {"softcap": 30.0}, "window": {"window_size": (256, 0)},
           "alibi": {"alibi_slopes": True}, "dropout": {"dropout_p": 0.1, "seed": 1234}}


def write(path):
    import cupy
    import cupyflash
    from cupyflash._arrays import bfloat16_dtype
    results = {}
    for dtype_name in ("bfloat16", "float16"):
        dtype = bfloat16_dtype() if dtype_name == "bfloat16" else numpy.dtype(dtype_name)
        for hd, s, causal in SHAPES:
            for name, options in OPTIONS.items():
                if name != "plain" and s != 1000:
                    continue
                rng = cupy.random.default_rng(hd * 100003 + s * 7 + causal)
                nheads = 2048 // hd // 4
                q, k, v = (rng.standard_normal((2, s, nheads, hd), dtype=cupy.float32).astype(dtype) for _ in range(3))
                options = dict(options)
                if options.get("alibi_slopes") is True:
                    options["alibi_slopes"] = cupy.linspace(0.01, 0.5, nheads, dtype=cupy.float32)
                out, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, **options)
                key = f"{dtype_name}_{hd}_{s}_{int(causal)}_{name}"
                results[key + "_out"] = cupy.asnumpy(out.view(cupy.uint16))
                results[key + "_lse"] = cupy.asnumpy(lse)
                if name in ("plain", "softcap") and s < 4096:  # (the gradients of 4k rows: 100 MB a call)
                    dout = rng.standard_normal(out.shape, dtype=cupy.float32).astype(dtype)
                    grads = cupyflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                                                          **options)
                    for grad_name, grad in zip(("dq", "dk", "dv"), grads):
                        results[f"{key}_{grad_name}"] = cupy.asnumpy(grad.view(cupy.uint16 if grad.dtype.itemsize == 2 else cupy.uint32))
    numpy.savez(path, **results)
    print(f"{len(results)} arrays written to {path}")


def compare(a_path, b_path):
    a, b = numpy.load(a_path), numpy.load(b_path)
    differ = [key for key in a.files if not numpy.array_equal(a[key], b[key], equal_nan=True)]
    print(f"{len(a.files) - len(differ)} of {len(a.files)} arrays bit for bit the same")
    for key in differ:
        diff = numpy.count_nonzero(a[key] != b[key])
        print(f"  differs: {key} ({diff} of {a[key].size} elements)")
    return 1 if differ or set(a.files) != set(b.files) else 0


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2])
    else:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
