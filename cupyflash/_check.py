"""Correctness cases against the float64 reference, shared by `python -m cupyflash check` and the tests.

The rule, from FlashAttention's own tests: the kernel's largest error against the float64 reference
may be at most 2x the error of the same computation done naively in the same low precision
(reference.attention_*_lowp), 3x for gradients; plus one unit in the last place of the dtype at the
output's scale, and 1/64 of one at unit scale (the inputs are unit normals): exact cancellations,
such as dS = 0 with a single key, make the low-precision error 0 while float32 accumulation
still leaves noise far below the dtype's resolution.
Inputs are fresh random normals rounded to the dtype, never zeros.
"""

import dataclasses
import math

import numpy

from . import options, reference

_UNIT_ROUNDOFF = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


@dataclasses.dataclass(frozen=True, init=False)
class Case:
    """One correctness case: sizes, dtype, causal, layout, and the options by cupyflash.options'
    names (keyword arguments; an array option's setting is its form, see options.Option.forms, or
    True for the usual one). For varlen, batch is the number of sequences and seqlen_* their maxima."""
    seqlen_q: int
    seqlen_k: int
    headdim: int
    dtype: str
    causal: bool
    batch: int
    nheads: int
    nheads_k: int
    layout: str      # 'separate'; 'qkvpacked': q, k, v are views of one (b, s, 3, h, d) array;
                     # 'misaligned': every input starts 2 bytes past a 16-byte boundary
    varlen: tuple    # per-sequence lengths (q, k), or ()
    key_scale: tuple  # k's rows scaled from key_scale[0] (first key) to key_scale[1] (last), geometrically:
                      # scores that grow or shrink along the keys move a row's running maximum block after block
    score_shift: float  # every score of an even query row raised by about this much (in softmax units,
                        # scale q . k), every score of an odd row lowered: q and k share a direction.
                        # Far past softcap, every capped score of a row is near +cap or near -cap
    options: tuple   # ((name, setting), ...) in the options table's order, those that are on

    def __init__(self, seqlen_q, seqlen_k, headdim, dtype="bfloat16", causal=False, batch=2, nheads=2, nheads_k=2,
                 layout="separate", varlen=(), key_scale=(1.0, 1.0), score_shift=0.0, **settings):
        for name in settings:
            options.by_name(name)  # KeyError for a name that is no option
        on = tuple((o.name, o.forms[0] if settings[o.name] is True and o.forms else settings[o.name])
                   for o in options.OPTIONS if settings.get(o.name) not in (None, False, "", 0, o.default))
        for field, value in dict(seqlen_q=seqlen_q, seqlen_k=seqlen_k, headdim=headdim, dtype=dtype, causal=causal,
                                 batch=batch, nheads=nheads, nheads_k=nheads_k, layout=layout, varlen=tuple(varlen),
                                 key_scale=tuple(key_scale), score_shift=float(score_shift), options=on).items():
            object.__setattr__(self, field, value)

    def setting(self, name):
        """The option's setting, or None when it is off."""
        return dict(self.options).get(name)

    def __str__(self):
        text = (f"{self.dtype} b{self.batch} sq{self.seqlen_q} sk{self.seqlen_k} h{self.nheads}/{self.nheads_k} "
                f"d{self.headdim}{' causal' if self.causal else ''}{' ' + self.layout if self.layout != 'separate' else ''}")
        extras = [f"{name}={value}" for name, value in self.options]
        extras += [f"varlen{self.varlen}"] * bool(self.varlen)
        extras += [f"key_scale{self.key_scale}"] * (self.key_scale != (1.0, 1.0))
        extras += [f"score_shift={self.score_shift:g}"] * bool(self.score_shift)
        return " ".join([text] + extras)

    @staticmethod
    def packed(lengths_q, lengths_k, headdim, dtype="bfloat16", causal=False, **fields):
        """A varlen case of sequences with these lengths."""
        return Case(max(lengths_q), max(lengths_k), headdim, dtype, causal, batch=len(lengths_q),
                    varlen=(tuple(lengths_q), tuple(lengths_k)), **fields)

    def cu_seqlens(self):
        return tuple(numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32) for lengths in self.varlen)


@dataclasses.dataclass
class Check:
    name: str
    error: float
    bound: float

    @property
    def ok(self):
        return bool(self.error <= self.bound)   # NaN fails


@dataclasses.dataclass
class Result:
    case: Case
    checks: list

    @property
    def ok(self):
        return all(c.ok for c in self.checks)

    def describe(self):
        return "; ".join(f"{c.name} err {c.error:.3g} (bound {c.bound:.3g}){'' if c.ok else ' FAIL'}"
                         for c in self.checks)


def random_inputs(case, seed):
    """q, k, v, dout as float32 NumPy arrays whose values are exactly representable in case.dtype,
    and the case's option arrays (options.Option.example) and seed. (A 'heads' bias is representable
    in case.dtype and reaches the kernels in that dtype: _in_q_dtype; the others are float32.)"""
    rng = numpy.random.default_rng(seed)
    b, sq, sk, h, hk, d = case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_k, case.headdim
    shapes = {"q": (b, sq, h, d), "k": (b, sk, hk, d), "v": (b, sk, hk, d), "dout": (b, sq, h, d)}
    if case.varlen:
        total_q, total_k = sum(case.varlen[0]), sum(case.varlen[1])
        shapes = {"q": (total_q, h, d), "k": (total_k, hk, d), "v": (total_k, hk, d), "dout": (total_q, h, d)}
    inputs = {name: rng.standard_normal(shape, dtype=numpy.float32) for name, shape in shapes.items()}
    if case.key_scale != (1.0, 1.0):
        ramp = numpy.geomspace(*case.key_scale, shapes["k"][-3], dtype=numpy.float32)
        inputs["k"] *= ramp[:, None, None]
    if case.score_shift:
        # A direction e with scale |e|^2 = 1 at scale = d^-1/2; q's rows gain +-sqrt(shift) e, k's +sqrt(shift) e.
        e = numpy.full(d, d ** -0.25, dtype=numpy.float32) * numpy.float32(case.score_shift ** 0.5)
        inputs["q"] += numpy.where(numpy.arange(shapes["q"][-3]) % 2, -1, 1).astype(numpy.float32)[:, None, None] * e
        inputs["k"] += e
    inputs = {name: reference.round_to(x, case.dtype) for name, x in inputs.items()}
    sizes = (b, h, sq, sk)
    for name, setting in case.options:
        option = options.by_name(name)
        if option.kind == "array":
            inputs[name] = option.example(rng, sizes, setting)
        for needed in option.needs:
            inputs[needed] = options.by_name(needed).example(rng, sizes, None)
    for name in _in_q_dtype(case):
        inputs[name] = reference.round_to(inputs[name], case.dtype)
    return inputs


def _in_q_dtype(case):
    """The case's arrays that reach the kernels in q's dtype: a differentiable option's (a bias) in
    its 'heads' form, so 16-bit biases are covered; every other array is float32."""
    return [name for name, setting in case.options if options.by_name(name).gradient and setting == "heads"]


def _has_gradient(case):
    return any(options.by_name(name).gradient for name, _ in case.options)


def options_of(case, inputs):
    """The keyword options of flash_attn_func (or, with deterministic, its backward) for `case`,
    with `inputs`' arrays and seed (any kind)."""
    result = {name: inputs[name] if options.by_name(name).kind == "array" else setting
              for name, setting in case.options}
    if "seed" in inputs:
        result["seed"] = inputs["seed"]
    return result


def forward_options(case, inputs):
    """options_of without the backward's own options."""
    taken = {o.name for o in options.for_call("fwd", bool(case.varlen))}
    return {name: value for name, value in options_of(case, inputs).items() if name in taken}


def to_cupy_inputs(case, inputs):
    """CuPy arrays of case.dtype holding `inputs`; for 'qkvpacked', q, k, v are views of one array."""
    import cupy
    from ._arrays import bfloat16_dtype
    dtype = bfloat16_dtype() if case.dtype == "bfloat16" else numpy.dtype(case.dtype)
    if case.layout == "qkvpacked":
        if case.seqlen_q != case.seqlen_k or case.nheads != case.nheads_k:
            raise ValueError("a packed qkv case needs seqlen_q == seqlen_k and nheads == nheads_k")
        packed = cupy.asarray(numpy.stack([inputs["q"], inputs["k"], inputs["v"]], axis=2).astype(dtype))
        arrays = {"q": packed[:, :, 0], "k": packed[:, :, 1], "v": packed[:, :, 2]}
        arrays["dout"] = cupy.asarray(inputs["dout"].astype(dtype))
    elif case.layout == "misaligned":
        arrays = {}
        for name in ("q", "k", "v", "dout"):
            buffer = cupy.empty(inputs[name].size + 1, dtype)
            arrays[name] = buffer[1:].reshape(inputs[name].shape)  # contiguous strides, odd element offset
            arrays[name][...] = cupy.asarray(inputs[name].astype(dtype))
    else:
        arrays = {name: cupy.asarray(inputs[name].astype(dtype)) for name in ("q", "k", "v", "dout")}
    in_q_dtype = _in_q_dtype(case)
    for name, setting in case.options:
        if options.by_name(name).kind == "array":
            arrays[name] = cupy.asarray(inputs[name].astype(dtype if name in in_q_dtype else numpy.float32))
    return arrays


def _max_error(x, ref, mask=None):
    x, ref = numpy.asarray(x, dtype=numpy.float64), numpy.asarray(ref, dtype=numpy.float64)
    if mask is not None:
        x, ref = x[mask], ref[mask]
    return float(numpy.abs(x - ref).max()) if x.size else 0.0


def _floor(dtype, ref):
    """One ulp of `dtype` at the scale of `ref`, plus 1/64 ulp at unit scale (see the module doc)."""
    return _UNIT_ROUNDOFF[dtype] * (float(numpy.abs(ref).max(initial=0)) + 2.0 ** -6)


def _references(case, inputs, backward):
    """(float64 out, lse, grads) and the low-precision (out, lse, grads); grads end with dbias
    when the case has a bias."""
    q, k, v, dout = (inputs[n] for n in ("q", "k", "v", "dout"))
    scale = case.headdim ** -0.5
    kwargs = {name: value for name, value in options_of(case, inputs).items() if options.by_name(name).reference}
    if case.varlen:
        cu = case.cu_seqlens()
        ref = reference.attention_forward_varlen(q, k, v, *cu, scale, case.causal, **kwargs)
        lowp = reference.attention_forward_varlen_lowp(q, k, v, *cu, case.dtype, scale, case.causal, return_lse=True,
                                                      **kwargs)
        ref_grads = lowp_grads = None
        if backward:
            ref_grads = reference.attention_backward_varlen(dout, q, k, v, *cu, scale, case.causal, **kwargs)
            lowp_grads = reference.attention_backward_varlen_lowp(dout, q, k, v, *cu, case.dtype, scale, case.causal,
                                                                  **kwargs)
        return (*ref, ref_grads), (*lowp, lowp_grads)
    dbias = dict(return_dbias=True) if _has_gradient(case) else {}
    ref = reference.attention_forward(q, k, v, scale, case.causal, **kwargs)
    lowp = reference.attention_forward_lowp(q, k, v, case.dtype, scale, case.causal, return_lse=True, **kwargs)
    ref_grads = lowp_grads = None
    if backward:
        ref_grads = reference.attention_backward(dout, q, k, v, scale, case.causal, **kwargs, **dbias)
        lowp_grads = reference.attention_backward_lowp(dout, q, k, v, case.dtype, scale, case.causal, **kwargs, **dbias)
    return (*ref, ref_grads), (*lowp, lowp_grads)


def compare(case, inputs, out, lse, grads):
    """Checks of out, lse and (dq, dk, dv[, dbias]) (NumPy arrays) against the reference for `inputs`."""
    (ref_out, ref_lse, ref_grads), (lowp_out, lowp_lse, lowp_grads) = _references(case, inputs, grads is not None)
    checks = [Check("out", _max_error(out, ref_out),
                    2 * _max_error(lowp_out, ref_out) + _floor(case.dtype, ref_out))]

    # lse: rows that see no key must be exactly -inf; the others follow the 2x rule against the
    # log-sum-exp of scores rounded to the dtype (what a naive low-precision computation would get).
    lse = numpy.asarray(lse, dtype=numpy.float64)
    empty = numpy.isneginf(ref_lse)
    # lse is float32 whatever the dtype: its floor is one float32 ulp at its scale.
    lse_bound = 2 * _max_error(lowp_lse, ref_lse, ~empty) + 2.0 ** -23 * float(numpy.abs(ref_lse[~empty]).max(initial=1))
    lse_error = _max_error(lse, ref_lse, ~empty)
    if not numpy.array_equal(numpy.isneginf(lse), empty):
        lse_error = math.inf
    checks.append(Check("lse", lse_error, lse_bound))

    if grads is not None:
        for name, got, ref, lowp in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, lowp_grads):
            checks.append(Check(name, _max_error(got, ref),
                                3 * _max_error(lowp, ref) + _floor(case.dtype, ref)))
    return Result(case, checks)


def run_gpu_case(case, seed, wrap=None, unwrap=None, backward=True):
    """Runs cupyflash on the GPU for `case` and compares with the reference.

    `wrap` turns the CuPy inputs into another framework's arrays (e.g. torch.from_dlpack) and
    `unwrap` turns results back into something numpy.asarray accepts; by default CuPy in and out."""
    import cupy
    from .api import flash_attn_backward, flash_attn_func, flash_attn_varlen_backward, flash_attn_varlen_func
    wrap = wrap or (lambda x: x)
    unwrap = unwrap or cupy.asnumpy
    inputs = random_inputs(case, seed)
    arrays = {name: wrap(a) for name, a in to_cupy_inputs(case, inputs).items()}
    scale = case.headdim ** -0.5
    given = dict(arrays, seed=inputs.get("seed"))
    forward, backward_options = forward_options(case, given), options_of(case, given)
    q, k, v, dout = (arrays[n] for n in ("q", "k", "v", "dout"))
    grads = None
    if case.varlen:
        cu = [wrap(cupy.asarray(c)) for c in case.cu_seqlens()]
        lengths = (case.seqlen_q, case.seqlen_k)
        out, lse = flash_attn_varlen_func(q, k, v, *cu, *lengths, scale, case.causal, return_lse=True, **forward)
        if backward:
            grads = flash_attn_varlen_backward(dout, q, k, v, out, lse, *cu, *lengths, scale, case.causal,
                                               **backward_options)
    else:
        out, lse = flash_attn_func(q, k, v, scale, case.causal, return_lse=True, **forward)
        if backward:
            grads = flash_attn_backward(dout, q, k, v, out, lse, scale, case.causal,
                                        return_dbias=_has_gradient(case), **backward_options)
    if grads is not None:
        grads = [_to_float64(unwrap(g)) for g in grads]
    return compare(case, inputs, _to_float64(unwrap(out)), _to_float64(unwrap(lse)), grads)


def _to_float64(x):
    return numpy.asarray(x).astype(numpy.float64)
