"""Every attention option, declared once.

Each row of OPTIONS says what an option is (name, kind, default, the passes and calls that take
it), how its value is checked, which FlashParams fields it fills, which kernels it needs when it
is on, and an example value that turns it on. Everything else derives from this table: the public
signatures and their docs (api.py), validation (validate.py), launch-plan keys and the parameter
block (_plan.py), the kernel variant (_plan.py), the PyTorch op schemas (torch.py), the JAX custom
call attributes and operands (jax.py), and the check grid and test matrices (_check.py, tests/).

A new score option (one that changes the scores, such as softcap) touches four places: a field in
cuda_src/common/params.cuh, a functor in cuda_src/common/score.cuh, a row here, and the reference
math in cupyflash/reference/.

Kinds, and how each travels:
  pair   two ints       torch: two int arguments named by `parts`; JAX: two int64 attributes
  real   a float        torch: float; JAX: a float64 attribute
  flag   a bool         torch: bool; JAX: a bool attribute
  array  an array       torch: Tensor?; JAX: an operand (and a has_<name> attribute)
  seed   the Philox key torch: an int64 scalar Tensor?; JAX: a uint32 (2,) operand `dropout_seed`
"""

import dataclasses
import inspect
import math
import numbers
import operator
import textwrap
from typing import Callable

import numpy

from . import _arrays

UNBOUNDED = 1 << 30  # a window side with no bound, as cuda_src/common/mask.cuh expects
ALIBI_MAX_TOKENS = 1 << 23  # ALiBi distances stay below 2^23: cuda_src/common/score.cuh, small_int_to_float


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    kind: str
    default: object
    doc: str
    check: Callable               # check(value, call) -> the value as the kernels and the reference take it
    fill: Callable = None         # fill(fields, value, call, inputs): its FlashParams fields, not pointers
    kernels: str = ""             # what the kernels need when it is on: 'local', 'deterministic', or the
                                  # feature compiled in for it (cupyflash/_kernels.py, FEATURES)
    passes: tuple = ("fwd", "bwd")   # and "kvcache": flash_attn_with_kvcache takes it
    varlen: bool = True           # whether the varlen functions take it
    parts: tuple = ()             # a pair's two ints, as named in torch op schemas and JAX attributes
    example: Callable = None      # example(rng, sizes, form) -> a value that turns it on (test grids)
    forms: tuple = ()             # an array's shapes in test grids (its example's `form`), the first the usual
    needs: tuple = ()             # options that must be given with it (dropout_p: its seed)
    gradient: bool = False        # whether the backward can return its gradient
    reference: bool = True        # whether the reference takes it (not options that only order the sums)

    def is_on(self, value):
        """Whether a checked value does anything."""
        return value is not None if self.kind in ("array", "seed") else value != self.default


def for_call(pass_, varlen=False):
    """The options a public function takes, in signature order."""
    return tuple(o for o in OPTIONS if pass_ in o.passes and (o.varlen or not varlen))


def by_name(name):
    return _BY_NAME[name]


def add_to_signature(function, taken, public_name=lambda option: option.name):
    """Gives `function` (which takes the options as **given) the options `taken` as keyword-only
    parameters of its signature, before its own keyword-only ones."""
    own = inspect.signature(function)
    params = [p for p in own.parameters.values() if p.kind != p.VAR_KEYWORD]
    first_keyword = next((i for i, p in enumerate(params) if p.kind == p.KEYWORD_ONLY), len(params))
    added = [inspect.Parameter(public_name(o), inspect.Parameter.KEYWORD_ONLY, default=o.default) for o in taken]
    function.__signature__ = own.replace(parameters=params[:first_keyword] + added + params[first_keyword:])


def settings(varlen=False, every_form=True):
    """The test matrix of the options: {case name: {option name: setting}}, one case per option (per
    form for arrays, whose setting is the form; only the usual form without every_form) and one
    with every option on. An array's setting becomes an array through example(rng, sizes, form);
    seeds are left to each caller."""
    matrix, every = {}, {}
    for option in OPTIONS:
        if option.kind == "seed" or (varlen and not option.varlen):
            continue
        for form in (option.forms if every_form else option.forms[:1]) or (None,):
            setting = form if option.kind == "array" else option.example(None, None, None)
            matrix[option.name if form is None else f"{option.name}-{form}"] = {option.name: setting}
            every.setdefault(option.name, setting)
    matrix["all"] = every
    return matrix


# --------------------------------------------------------------------------------------------
# The checks. `call` is validate.Call: shape (batch, nheads, seqlen_q, seqlen_k, headdim), dtype
# (q's), causal, and `checked`, the options checked so far (in table order).

def _real(name, value, rule):
    """value as a float; TypeError naming `name` and `rule` unless it is a real number (as the drop-ins
    and softmax_scale refuse a value that is not a number)."""
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {rule}, got {value!r}")
    return float(value)


def window_bounds(causal, window_size=(-1, -1)):
    """(left, right) of the attention window with causal folded in as right = 0 (causal hides every
    key right of the diagonal, so the intersection is the window with right = 0); -1 is unbounded."""
    try:
        left, right = (operator.index(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of integers >= -1, got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 means unbounded), got {window_size!r}")
    return left, (0 if causal else right)


def _fill_window(fields, window, call, inputs):
    fields["window_left"], fields["window_right"] = (UNBOUNDED if side < 0 else side for side in window)


def _check_softcap(value, call):
    rule = "a finite number >= 0 (0 disables it)"
    softcap = _real("softcap", value, rule)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be {rule}, got {value!r}")
    return softcap


def _fill_softcap(fields, softcap, call, inputs):
    fields["softcap_inner"], fields["softcap_outer"] = call.scale / softcap, softcap / call.scale


def _score_array_dtypes(call):
    """The dtypes a score array (alibi_slopes, attn_bias) may have: float32, or q's own when q is
    float32 or float64 (the NumPy path)."""
    return ("float32",) if call.dtype in ("float16", "bfloat16", "float32") else ("float32", call.dtype)


def _check_alibi(slopes, call):
    if slopes is None:
        return None
    _check_array("alibi_slopes", slopes, call)
    allowed = _score_array_dtypes(call)
    if _arrays.dtype_name(slopes) not in allowed:
        raise TypeError(f"alibi_slopes must have dtype {' or '.join(allowed)}, got {_arrays.dtype_name(slopes)}")
    s = call.shape
    if tuple(slopes.shape) not in ((s.nheads,), (s.batch, s.nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({s.nheads},) or (batch, nheads) = "
                         f"({s.batch}, {s.nheads}), got {tuple(slopes.shape)}")
    if s.seqlen_q + s.seqlen_k > ALIBI_MAX_TOKENS:
        raise ValueError(f"alibi_slopes takes seqlen_q + seqlen_k up to 2**23 = {ALIBI_MAX_TOKENS} (the kernels' exact "
                         f"float distances), got {s.seqlen_q} + {s.seqlen_k}")
    return slopes


def _fill_alibi(fields, slopes, call, inputs):
    slopes = inputs["alibi_slopes"]
    fields["alibi_batch_stride"] = _arrays.element_strides(slopes)[0] if len(slopes.shape) == 2 else 0


def _check_bias(bias, call):
    if bias is None:
        return None
    _check_array("attn_bias", bias, call)
    allowed = tuple(dict.fromkeys(("float32", call.dtype)))
    if _arrays.dtype_name(bias) not in allowed:
        raise TypeError(f"attn_bias must have dtype {' or '.join(allowed)}, got {_arrays.dtype_name(bias)}")
    s = call.shape
    full = (s.batch, s.nheads, s.seqlen_q, s.seqlen_k)
    shape = tuple(bias.shape)
    if not 2 <= len(shape) <= 4 or shape[-1] != full[3] or any(
            size not in (1, want) for size, want in zip(shape[-2::-1], full[2::-1])):
        raise ValueError(f"attn_bias must broadcast from (batch or 1, nheads or 1, seqlen_q or 1, seqlen_k) = "
                         f"{full}, got shape {shape}")
    return bias


def broadcast_strides(shape, strides):
    """Strides of an array of 2 to 4 dims seen as 4-D, with 0 along every broadcast (size-1) dimension."""
    pad = 4 - len(shape)
    return tuple(0 if size == 1 else stride
                 for size, stride in zip((1,) * pad + tuple(shape), (0,) * pad + tuple(strides)))


def _fill_bias(fields, bias, call, inputs):
    bias = inputs["attn_bias"]
    fields["bias_is_float32"] = int(_arrays.dtype_name(bias) == "float32")
    fields["bias_batch_stride"], fields["bias_head_stride"], fields["bias_row_stride"] = \
        broadcast_strides(bias.shape, _arrays.element_strides(bias))[:3]


def check_dropout_p(value, call=None):
    """dropout_p as a float in [0, 1) (a bool is not a probability)."""
    rule = "a real number in [0, 1)"
    p = _real("dropout_p", value, rule)
    if not 0 <= p < 1:  # NaN fails too
        raise ValueError(f"dropout_p must be {rule}, got {value!r}")
    return p


DROPOUT_BITS = 8  # random bits per element (cuda_src/common/score.cuh: kDropoutBits)


def dropout_keep_threshold(dropout_p):
    """The keep count k: an element is kept iff its DROPOUT_BITS random bits, an integer, are below k.

    The kept fraction k / 2**DROPOUT_BITS is 1 - dropout_p rounded to the nearest multiple of
    2**-DROPOUT_BITS (halves up; at least one step, so something is kept), and the kept elements
    are scaled by its inverse (dropout_rescale), so the expectation holds exactly. (dropout_p = 0
    means no dropout at all rather than this rule.)"""
    steps = 2 ** DROPOUT_BITS
    return max(1, math.floor((1.0 - dropout_p) * steps + 0.5))


def dropout_rescale(dropout_p):
    """The factor of the kept probabilities: 1 / the kept fraction (1 / (1 - dropout_p), rounded as
    dropout_keep_threshold rounds it)."""
    return 2 ** DROPOUT_BITS / dropout_keep_threshold(dropout_p)


def _fill_dropout(fields, dropout_p, call, inputs):
    # The kernels compare the element's bits placed on top of a 32-bit word against this bound.
    fields["dropout_keep_max"] = (dropout_keep_threshold(dropout_p) << (32 - DROPOUT_BITS)) - 1
    fields["dropout_scale"] = dropout_rescale(dropout_p)


def _check_seed(seed, call):
    """The Philox key as an int in [0, 2**64) when dropout is on; None (ignored) otherwise."""
    dropout_p = call.checked.get("dropout_p", 0.0)
    return check_seed(seed, dropout_p) if dropout_p else None


SEED_ARRAY = "a uint32 array of shape (2,) (low word, high word) or an int64 or uint64 array of one element"


def is_seed_array(seed):
    """Whether a seed is an array (read on the device); a NumPy scalar is an integer."""
    return hasattr(seed, "shape") and hasattr(seed, "dtype") and not isinstance(seed, numpy.generic)


def check_seed(seed, dropout_p):
    """seed as a Python int in [0, 2**64), for a call with dropout_p > 0; or an array holding its
    8 bytes, which the kernels read on the device (so a CUDA graph's replays can draw new seeds):
    a GPU array as it is, a NumPy array as the int it holds."""
    if seed is None:
        raise ValueError(f"seed is required when dropout_p > 0 (dropout_p={dropout_p!r}): "
                         f"pass an integer in [0, 2**64) or {SEED_ARRAY}")
    if is_seed_array(seed):
        dtype, shape = _arrays.dtype_name(seed), tuple(seed.shape)
        if not ((dtype == "uint32" and shape == (2,)) or (dtype in ("int64", "uint64") and shape in ((), (1,)))):
            raise TypeError(f"seed must be an integer in [0, 2**64) or {SEED_ARRAY}; got an array of dtype {dtype} and "
                            f"shape {shape}")
        if isinstance(seed, numpy.ndarray):
            return int(numpy.ascontiguousarray(seed).reshape(-1).view(numpy.uint64)[0])
        return seed
    if isinstance(seed, (bool, numpy.bool_)) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def check_flag(name, value):
    if not isinstance(value, (bool, numpy.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _check_array(name, value, call):
    """An option array: of the call's kind (checked with the other arrays) and, on every path, with
    a contiguous last dimension as the kernels read it."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(value).__name__}")
    strides = _arrays.element_strides(value)
    if strides is not None and len(strides) and value.shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {strides} (in elements)")


# --------------------------------------------------------------------------------------------
# Examples that turn each option on, for the check grid and the tests: sizes is (batch, nheads,
# seqlen_q, seqlen_k); arrays are float32 NumPy arrays of the form asked for.

def _example_alibi(rng, sizes, form):
    batch, nheads = sizes[:2]
    return rng.uniform(0.05, 0.55, {"batch": (batch, nheads), "heads": (nheads,)}[form]).astype(numpy.float32)


def _example_bias(rng, sizes, form):
    batch, nheads, seqlen_q, seqlen_k = sizes
    shape = {"full": sizes, "heads": (nheads, seqlen_q, seqlen_k), "keys": (seqlen_q, seqlen_k),
             "padding": (batch, 1, 1, seqlen_k)}[form]
    return rng.standard_normal(shape).astype(numpy.float32)


OPTIONS = (
    Option("window_size", "pair", (-1, -1),
           "(left, right): query i sees keys [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]; "
           "-1 leaves a side unbounded. Blocks outside the window are skipped, not computed.",
           lambda value, call: window_bounds(call.causal, value), _fill_window, kernels="local", parts=("window_left", "window_right"),
           passes=("fwd", "bwd", "kvcache"),
           example=lambda rng, sizes, form: (3, 1)),
    Option("softcap", "real", 0.0, "> 0: scores become softcap * tanh(scores / softcap)",
           _check_softcap, _fill_softcap, kernels="softcap", passes=("fwd", "bwd", "kvcache"),
           example=lambda rng, sizes, form: 1.5),
    Option("alibi_slopes", "array", None,
           "float32 (nheads,) or (batch, nheads): head h adds -slope * |i + seqlen_k - seqlen_q - j| (no gradient); "
           "seqlen_q + seqlen_k up to 2**23",
           _check_alibi, _fill_alibi, kernels="alibi", passes=("fwd", "bwd", "kvcache"), example=_example_alibi,
           forms=("batch", "heads")),
    Option("attn_bias", "array", None,
           "an additive bias broadcastable from (batch or 1, nheads or 1, seqlen_q or 1, seqlen_k) (a key "
           "padding mask is (batch, 1, 1, seqlen_k)), float32 or q's dtype; its gradient is dbias",
           _check_bias, _fill_bias, kernels="bias", varlen=False, example=_example_bias,
           forms=("full", "heads", "keys", "padding"),
           gradient=True),
    Option("dropout_p", "real", 0.0,
           "probability of dropping an attention probability, in [0, 1), applied as a multiple of 2**-8 "
           "(dropout_keep_threshold); needs `seed`",
           check_dropout_p, _fill_dropout, kernels="dropout", needs=("seed",), example=lambda rng, sizes, form: 0.17),
    Option("seed", "seed", None,
           "an int in [0, 2**64), or an array on q's device holding its 8 bytes (uint32 (2,): low word, high "
           "word; or int64 of one element), read by the kernels so that a CUDA graph's replays can use new "
           "seeds: the Philox key of the dropout mask. The backward must get the same seed, and regenerates "
           "the mask instead of storing it.",
           _check_seed, example=lambda rng, sizes, form: int(rng.integers(0, 2 ** 63)) * 2 + 1),
    Option("deterministic", "flag", False,
           "the backward adds dq in a fixed order: bitwise reproducible (the default adds by atomics)",
           lambda value, call: check_flag("deterministic", value), kernels="deterministic", passes=("bwd",),
           example=lambda rng, sizes, form: True, reference=False),
)
_BY_NAME = {o.name: o for o in OPTIONS}
DIFFERENTIABLE = next(o.name for o in OPTIONS if o.gradient)  # the option whose gradient return_dbias asks for

ORDER = "Order, as in the reference: s = q k^T * scale, then softcap, then + ALiBi + attn_bias, then the mask."


def doc(pass_, varlen=False):
    """The options' part of a public function's docstring."""
    lines = ["", "    Options (flash_attn's names and meaning; each default means off, and all combine):"]
    for o in for_call(pass_, varlen):
        lines += textwrap.wrap(o.doc, 100, initial_indent=f"      {o.name:<14}", subsequent_indent=" " * 20)
    return "\n".join(lines + textwrap.wrap(ORDER, 100, initial_indent="    ", subsequent_indent="    ") + [""])
