"""The attention options on the GPU (window, softcap, ALiBi, attn_bias, dropout, deterministic,
varlen), alone and in pairs with each other, causal and GQA, against the float64 reference
(cupyflash/_check.py states the tolerance rule); plus the structural checks of dropout and
determinism."""

import itertools
import zlib

import numpy
import pytest

from cupyflash import _check, options, reference
from cupyflash._check import Case

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_allocations")]

# Each option once (cupyflash.options' examples), a window wider than its example's.
OPTIONS = {name: spec for name, spec in options.settings(every_form=False).items() if name != "all"}
OPTIONS["window_size"] = dict(window_size=(37, 11))


def _seed(case):
    return zlib.crc32(str(case).encode())


def _assert_ok(case):
    result = _check.run_gpu_case(case, _seed(case))
    assert result.ok, f"{result.case}: {result.describe()}"


# Each option alone, with and without causal and GQA, in both dtypes, at odd lengths and head dims.
SINGLE = [Case(sq, sk, d, dtype, causal, nheads=4, nheads_k=hk, **fields)
          for (name, fields), causal, (dtype, sq, sk, d, hk) in itertools.product(
              OPTIONS.items(), (False, True),
              [("float16", 113, 200, 96, 4), ("bfloat16", 200, 113, 64, 2), ("bfloat16", 17, 1000, 128, 1)])]
# Every pair of options, alternating dtype, causal and GQA.
PAIRS = [Case(113 + 8 * i, 150, 72 if i % 2 else 128, ("float16", "bfloat16")[i % 2], bool(i // 2 % 2),
              nheads=4, nheads_k=(4, 2, 1)[i % 3], **a, **b)
         for i, (a, b) in enumerate((OPTIONS[x], OPTIONS[y]) for x, y in itertools.combinations(OPTIONS, 2))]
# Windows at their edges; bias shapes that broadcast (and a bias in q's dtype: 'heads'), a float32
# bias of the call's own shape with one batch entry and head.
EDGES = [Case(113, 113, 64, "bfloat16", False, window_size=(0, 0)),
         Case(200, 113, 64, "float16", False, window_size=(-1, 0)),     # the same mask as causal
         Case(113, 200, 64, "float16", True, window_size=(5, -1)),      # causal with a left window
         Case(113, 113, 64, "bfloat16", False, window_size=(500, 500)),  # wider than the sequence
         Case(300, 300, 256, "bfloat16", True, window_size=(64, 0)),
         Case(113, 150, 64, "bfloat16", True, attn_bias="heads", nheads=4, nheads_k=2),
         Case(113, 150, 160, "float16", False, attn_bias="keys", batch=3),
         Case(113, 150, 64, "bfloat16", True, attn_bias="keys", deterministic=True),
         Case(113, 150, 64, "bfloat16", True, attn_bias="padding", nheads=4, nheads_k=2),  # rows broadcast
         Case(200, 113, 128, "float16", False, attn_bias="padding", batch=3, deterministic=True),
         Case(113, 150, 96, "bfloat16", False, attn_bias="full", batch=1, nheads=1, nheads_k=1),  # float32, one writer each
         Case(1, 1, 64, "float16", False, softcap=0.5, alibi_slopes=True, attn_bias="full", dropout_p=0.5),
         Case(257, 1000, 256, "bfloat16", True, softcap=3.0, alibi_slopes=True, dropout_p=0.1, window_size=(100, 20))]
# Varlen, with empty sequences on either side, alone and with each option but attn_bias.
VARLEN = [Case.packed(lq, lk, d, dtype, causal, nheads=4, nheads_k=hk, **fields)
          for (lq, lk), (dtype, d, hk), causal, fields in itertools.product(
              [((0, 1, 17, 113, 5), (3, 0, 17, 200, 5)), ((1000, 17), (113, 1000))],
              [("bfloat16", 64, 2), ("float16", 128, 4)], (False, True),
              [{}] + [f for f in OPTIONS.values() if all(options.by_name(n).varlen for n in f)])]
# No query rows at all, or no key rows at all (the NumPy path takes them: so must every kernel family).
VARLEN += [Case.packed(lq, lk, d, dtype, causal, nheads=4, nheads_k=2, **fields)
           for (lq, lk), (dtype, d), causal, fields in itertools.product(
               [((0, 0), (3, 40)), ((3, 40), (0, 0))], [("bfloat16", 64), ("float16", 128)], (False, True),
               [{}, dict(softcap=1.5, alibi_slopes=True, dropout_p=0.2, deterministic=True)])]


@pytest.mark.parametrize("case", SINGLE + PAIRS + EDGES + VARLEN, ids=str)
def test_options_forward_backward(case):
    _assert_ok(case)


@pytest.mark.parametrize("layout", ["padded rows", "odd offset", "odd row stride"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_16bit_bias_views(layout, headdim):
    """The forward reads a 16-bit bias two columns a word where its rows start on 4-byte boundaries
    (padded rows: the last column, 151, alone) and column by column elsewhere (an odd element
    offset; an odd row stride): all against the reference."""
    import cupy
    from cupyflash import flash_attn_backward, flash_attn_func
    case = Case(113, 151, headdim, "bfloat16", True, nheads=4, nheads_k=2, attn_bias="heads")
    inputs = _check.random_inputs(case, _seed(case))
    arrays = _check.to_cupy_inputs(case, inputs)
    bias = arrays["attn_bias"]  # (nheads, seqlen_q, 151)
    rows, width = bias.shape[:-1], bias.shape[-1]
    if layout == "odd row stride":
        view = bias
    else:
        offset = 1 if layout == "odd offset" else 0
        buffer = cupy.full(offset + bias.size // width * (width + 1), cupy.nan, bias.dtype)
        view = buffer[offset:].reshape(*rows, width + 1)[..., :width]
        view[...] = bias
    q, k, v, dout = (arrays[name] for name in ("q", "k", "v", "dout"))
    out, lse = flash_attn_func(q, k, v, causal=True, attn_bias=view, return_lse=True)
    grads = flash_attn_backward(dout, q, k, v, out, lse, causal=True, attn_bias=view, return_dbias=True)
    as64 = lambda x: cupy.asnumpy(x).astype(numpy.float64)  # noqa: E731
    result = _check.compare(case, inputs, as64(out), as64(lse), [as64(g) for g in grads])
    assert result.ok, f"{layout}: {result.describe()}"


# 16-bit biases whose rows start on 16-byte boundaries (seqlen_k a multiple of 8), as the wgmma
# forward copies them into its ring of bias tiles: every broadcast form (over the rows: one row a
# box, added to every row), blocks cut short at both ends of the keys and rows, each head dim's
# tile (96 runs hd128's), causal and window.
BIAS_TILE_CASES = [
    (Case(300, 1000, 128, "bfloat16", True, batch=2, nheads=4, nheads_k=2, attn_bias="full"), "key mask"),
    (Case(1000, 136, 64, "float16", False, batch=2, nheads=4, attn_bias="full"), "one row"),
    (Case(1, 1000, 256, "bfloat16", False, batch=2, nheads=4, attn_bias="full"), "full"),
    (Case(1000, 1000, 64, "bfloat16", True, batch=2, nheads=4, nheads_k=2, attn_bias="full"), "full"),
    (Case(113, 200, 128, "float16", False, batch=2, nheads=4, attn_bias="full", deterministic=True), "heads broadcast"),
    (Case(300, 136, 256, "bfloat16", False, batch=2, nheads=4, nheads_k=1, attn_bias="full"), "batch broadcast"),
    (Case(17, 1000, 96, "bfloat16", True, nheads=4, attn_bias="full"), "keys"),
    (Case(1000, 8, 128, "float16", False, nheads=2, attn_bias="full"), "full"),
    (Case(200, 1000, 64, "float16", False, batch=3, nheads=4, nheads_k=1, window_size=(100, 37), softcap=5.0,
          alibi_slopes=True, attn_bias="full"), "full"),
    (Case(777, 777 + 7, 128, "bfloat16", True, batch=2, nheads=4, dropout_p=0.2, attn_bias="full"), "full"),
]


@pytest.mark.parametrize("case, form", BIAS_TILE_CASES, ids=str)
def test_bias_tiles(case, form, monkeypatch):
    """A 16-bit bias with 16-byte aligned rows reaches the wgmma kernels through its tensor map (the
    plans' bias_box_rows), in any broadcast form: against the reference, forward and backward; the
    mma.sync family (and an odd seqlen_k or a float32 bias, the other tests) reads it itself."""
    import cupy
    from cupyflash import _plan, flash_attn_backward, flash_attn_func
    monkeypatch.setattr(_plan, "_plans", {})
    inputs = _check.random_inputs(case, _seed(case))
    bias = reference.round_to(inputs["attn_bias"], case.dtype)  # (batch, nheads, seqlen_q, seqlen_k)
    bias = {"full": bias, "heads broadcast": bias[:, :1], "batch broadcast": bias[:1], "keys": bias[0, 0],
            "key mask": bias[:, :1, :1], "one row": bias[0, 0, :1]}[form]
    inputs["attn_bias"] = numpy.ascontiguousarray(bias)
    arrays = _check.to_cupy_inputs(case, inputs)
    arrays["attn_bias"] = arrays["attn_bias"].astype(arrays["q"].dtype)
    arrays.update({name: inputs[name] for name in ("seed",) if name in inputs})  # (dropout's)
    q, k, v, dout = (arrays[name] for name in ("q", "k", "v", "dout"))
    given = _check.forward_options(case, arrays)
    out, lse = flash_attn_func(q, k, v, causal=case.causal, return_lse=True, **given)
    grads = flash_attn_backward(dout, q, k, v, out, lse, causal=case.causal, return_dbias=True,
                                **_check.options_of(case, arrays))
    as64 = lambda x: cupy.asnumpy(x).astype(numpy.float64)  # noqa: E731
    result = _check.compare(case, inputs, as64(out), as64(lse), [as64(g) for g in grads])
    assert result.ok, result.describe()
    # Tiles wherever the kernel has room for their ring (every wgmma forward; the backward up to
    # hd128, without dropout), and a kernel with the ring where the plan maps the bias
    kernels = [(plan, k) for plan in _plan._plans.values() for k in plan.kernels if k.pass_ in ("fwd", "bwd")]
    assert {k.pass_ for _, k in kernels} == {"fwd", "bwd"}
    for plan, k in kernels:
        assert k.bias_tiles == (k.wgmma and k.tile.fits_bias_tiles(k.pass_, k.features)), k.name
        assert (int(plan.params["bias_box_rows"][0]) > 0) == k.bias_tiles, k.name
    assert all(k.bias_tiles for _, k in kernels if k.wgmma and k.pass_ == "fwd")
    # A LOCAL wgmma backward zeros the dbias rows its key blocks skip (one writer an element, rows on
    # 16-byte boundaries); the poisoned allocations show any it misses
    for plan, k in kernels:
        if k.pass_ == "bwd":
            zero_unseen = bool(plan.params["dbias_zero_unseen"][0])
            assert not zero_unseen or (k.wgmma and k.local), k.name
            if k.wgmma and k.local and form == "full" and case.seqlen_k % 8 == 0:
                assert zero_unseen, k.name


def test_packed_forms_take_views():
    """qkvpacked / kvpacked (and their varlen forms) agree with the separate call on the same views."""
    import cupy
    import cupyflash
    rng = numpy.random.default_rng(4)
    qkv = cupy.asarray(rng.standard_normal((2, 77, 3, 4, 64)), dtype=cupy.float16)
    expected = cupyflash.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, window_size=(9, 0))
    got = cupyflash.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(9, 0))
    assert bool(cupy.all(got == expected))
    got = cupyflash.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True, window_size=(9, 0))
    assert bool(cupy.all(got == expected))
    packed = qkv.reshape(2 * 77, 3, 4, 64)
    cu = cupy.asarray([0, 77, 154], dtype=cupy.int32)
    got = cupyflash.flash_attn_varlen_qkvpacked_func(packed, cu, 77, causal=True, window_size=(9, 0))
    assert bool(cupy.all(got.reshape(expected.shape) == expected))
    got = cupyflash.flash_attn_varlen_kvpacked_func(packed[:, 0], packed[:, 1:], cu, cu, 77, 77, causal=True,
                                                    window_size=(9, 0))
    assert bool(cupy.all(got.reshape(expected.shape) == expected))


def _dropout_probe(dropout_p, seed, batch=2, nheads=3, seqlen=64, headdim=64):
    """The keep masks the forward and the backward used, read off their outputs: with q = 0 every
    probability is 1 / seqlen_k, so with v = the identity out[i, j] = M[i, j] * rescale / seqlen_k,
    and with dout = the identity dv[j, i] = the same."""
    import cupy
    from cupyflash import flash_attn_backward, flash_attn_func
    eye = cupy.broadcast_to(cupy.eye(seqlen, headdim, dtype=cupy.float16)[None, :, None], (batch, seqlen, nheads, headdim))
    q = cupy.zeros((batch, seqlen, nheads, headdim), cupy.float16)
    k = cupy.asarray(numpy.random.default_rng(1).standard_normal(q.shape), dtype=cupy.float16)
    v = cupy.ascontiguousarray(eye)
    out, lse = flash_attn_func(q, k, v, dropout_p=dropout_p, seed=seed, return_lse=True)
    _, _, dv = flash_attn_backward(cupy.ascontiguousarray(eye), q, k, v, out, lse, dropout_p=dropout_p, seed=seed)
    forward = cupy.asnumpy(out.transpose(0, 2, 1, 3) > 0)         # (batch, heads, i, j)
    backward = cupy.asnumpy(dv.transpose(0, 2, 3, 1) > 0)         # dv[b, j, h, i] -> (b, h, i, j)
    expected_value = reference.dropout_rescale(dropout_p) / seqlen
    kept = cupy.asnumpy(out.transpose(0, 2, 1, 3))[forward]
    assert numpy.allclose(kept, expected_value, rtol=2e-3)
    return forward, backward


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_dropout_mask_is_the_references_and_the_same_in_both_passes(dropout_p):
    seed = 0x123456789ABCDEF
    forward, backward = _dropout_probe(dropout_p, seed)
    assert numpy.array_equal(forward, backward)
    assert numpy.array_equal(forward, reference.dropout_keep_mask(seed, dropout_p, *forward.shape))
    n = forward.size
    kept = forward.sum()
    keep = 1 / reference.dropout_rescale(dropout_p)  # the kept fraction: 1 - dropout_p to 2**-8
    sigma = (n * keep * (1 - keep)) ** 0.5
    assert abs(kept - n * keep) < 5 * sigma, (kept, n)
    other, _ = _dropout_probe(dropout_p, seed + 1)
    assert not numpy.array_equal(forward, other)
    again, _ = _dropout_probe(dropout_p, seed)
    assert numpy.array_equal(forward, again)


@pytest.mark.parametrize("headdim", [64, 128, 256])  # (on an H200 the three layouts of the wgmma backward)
def test_deterministic_backward_is_bitwise_reproducible(headdim):
    import cupy
    from cupyflash import flash_attn_backward, flash_attn_func
    for causal, hk, bias in ((False, 4, None), (True, 1, "keys")):
        case = Case(1000, 1000, headdim, "bfloat16", causal, batch=2, nheads=4, nheads_k=hk, attn_bias=bias or None)
        arrays = _check.to_cupy_inputs(case, _check.random_inputs(case, 8))
        q, k, v, dout = (arrays[n] for n in ("q", "k", "v", "dout"))
        options = dict(attn_bias=arrays["attn_bias"], return_dbias=True) if bias else {}
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, attn_bias=options.get("attn_bias"))
        runs = [[cupy.asnumpy(g).view(numpy.uint16 if g.dtype.itemsize == 2 else numpy.uint32)
                 for g in flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, **options)]
                for _ in range(6)]
        for run in runs[1:]:
            for got, first in zip(run, runs[0]):
                assert numpy.array_equal(got, first)


def test_bad_varlen_and_option_arguments_on_the_gpu():
    import cupy
    from cupyflash import flash_attn_func, flash_attn_varlen_func
    q = cupy.asarray(numpy.random.default_rng(2).standard_normal((30, 2, 64)), dtype=cupy.float16)
    good = cupy.asarray([0, 10, 30], dtype=cupy.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 array, got dtype int64"):
        flash_attn_varlen_func(q, q, q, good.astype(cupy.int64), good, 20, 20)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        flash_attn_varlen_func(q, q, q, good, cupy.asarray([0, 20, 10], dtype=cupy.int32), 20, 20)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flash_attn_varlen_func(q, q, q, good, good, 19, 20)
    q4 = q.reshape(1, 30, 2, 64)
    with pytest.raises(TypeError, match="alibi_slopes must have dtype float32"):
        flash_attn_func(q4, q4, q4, alibi_slopes=cupy.ones(2, cupy.float16))
    with pytest.raises(ValueError, match="attn_bias must broadcast"):
        flash_attn_func(q4, q4, q4, attn_bias=cupy.ones((1, 3, 30, 30), cupy.float32))
