"""PyTorch: cupyflash as torch custom ops, with fake tensors, autograd and torch.compile, and a
drop-in for flash_attn's functions:

    from cupyflash.torch import flash_attn_func   # was: from flash_attn import flash_attn_func

CUDA tensors run the kernels on torch's current stream, with outputs from torch's allocator. CPU
tensors run the NumPy float64 reference (slow; it lets opcheck, autograd and torch.compile be
tested without a GPU).

Every flash_attn option is supported: dropout_p, window_size, softcap, alibi_slopes,
deterministic, and the variable-length (varlen) functions; plus an `attn_bias` keyword of
cupyflash's own (an additive score bias, differentiable). Dropout's Philox key is drawn by the
Python functions from torch's default CPU generator (so torch.manual_seed fixes it) as an int64
scalar tensor, and passed to the forward and backward ops as an explicit input: the backward
regenerates the forward's mask from it, and the ops stay functional (opcheck-clean, traceable).
While a CUDA graph is captured the key is drawn on the device instead (torch's CUDA generator),
and the kernels read it there, so that every replay drops a new mask.
"""

import inspect
from typing import Optional

import numpy
import torch

from . import _config, _paged, api, options, validate
from ._arrays import bfloat16_dtype

if not hasattr(torch.library, "register_autograd"):
    raise ImportError("cupyflash.torch needs PyTorch 2.4 or newer (torch.library.register_fake, register_autograd); "
                      f"found {torch.__version__}")

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
           "draw_dropout_seed"]

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------
# Tensors to and from the core: CUDA tensors go as they are, CPU tensors as NumPy arrays.

def _to_core(t):
    if t is None:
        return None
    if t.dim() and t.stride(-1) != 1:
        t = t.contiguous()  # the kernels read whole head-dim rows; flash_attn copies such inputs too
    if t.is_cuda:
        return t  # the kernels read its address alone: no detach needed
    t = t.detach()  # .numpy() refuses tensors that require grad
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16 of torch's; float32 holds its values exactly
        return t.float().numpy().astype(bfloat16_dtype())
    return t.numpy()


def _from_core(x):
    if x is None or isinstance(x, torch.Tensor):
        return x
    if x.dtype == bfloat16_dtype():
        return torch.from_numpy(numpy.ascontiguousarray(x, dtype=numpy.float32)).to(torch.bfloat16)
    return torch.from_numpy(numpy.ascontiguousarray(x))  # contiguous, like the fake tensors below


def _lse_dtype(q):
    """lse's torch dtype for q's (validate.lse_dtype)."""
    return getattr(torch, validate.lse_dtype(str(q.dtype).replace("torch.", "")))


def _empty(like, shape=None, dtype=None):
    """A contiguous tensor, as the real implementations return (the fake ones must match strides)."""
    return torch.empty(like.shape if shape is None else shape, dtype=dtype or like.dtype, device=like.device)


# --------------------------------------------------------------------------------------------
# The custom ops, their arguments derived from cupyflash.options: q, k, v (dout, q, k, v, out, lse
# for a backward), the varlen packing, softmax_scale (always a number: the Python functions
# resolve None), causal, then every option of either pass in table order (a forward op takes the
# backward's options too, so that its autograd formula can pass them on), then the backward's
# return_dbias. A pair travels as two ints, an array as a Tensor?, the dropout seed as an int64
# scalar Tensor? (a CPU one is read on the host, a CUDA one by the kernels). Each option defaults
# to off.

_KIND_ANNOTATIONS = {"flag": bool, "real": float, "array": Optional[Tensor], "seed": Optional[Tensor]}


_LIBRARY = torch.library.Library("cupyflash", "FRAGMENT")
_infer_schema = getattr(torch.library, "infer_schema", None)
if _infer_schema is None:  # PyTorch 2.4
    from torch._library.infer_schema import infer_schema as _infer_schema


def _define(name, implementation, fake, mutates_args=()):
    """The OpOverload of a new op cupyflash::`name` whose schema is `implementation`'s signature
    (writing in place the arguments named by `mutates_args`).
    Defined through torch.library.Library rather than torch.library.custom_op, whose Python layers
    around the implementation (an aliasing check, a dispatch-key wrapper) cost ~15-20 us a call:
    compiled graphs call the ops at every step, and their backward on autograd's thread pays that
    again. The implementation serves every device (the core picks the kernels or NumPy)."""
    _LIBRARY.define(name + _infer_schema(implementation, mutates_args=mutates_args))
    # As custom_op does: torch.compile must not trace into the implementation when a graph runs it.
    _LIBRARY.impl(name, torch._disable_dynamo(implementation), "CompositeExplicitAutograd")
    torch.library.register_fake(f"cupyflash::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.cupyflash, name).default


def _option_parameters(varlen, pass_=None):
    """The ops' option arguments as inspect.Parameters, in table order: those of either pass, or
    of `pass_` alone."""
    params = []
    for option in options.OPTIONS:
        if (varlen and not option.varlen) or (pass_ is not None and pass_ not in option.passes):
            continue
        if option.kind == "pair":
            params += [_parameter(part, int, value) for part, value in zip(option.parts, option.default)]
        else:
            params.append(_parameter(option.name, _KIND_ANNOTATIONS[option.kind], option.default))
    return params


def _parameter(name, annotation, default=inspect.Parameter.empty):
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation, default=default)


def _core_options(arguments, pass_, varlen):
    """The core's keyword options from an op's bound arguments."""
    result = {}
    for option in options.for_call(pass_, varlen):
        if option.kind == "pair":
            value = tuple(arguments[part] for part in option.parts)
        elif option.kind == "array":
            value = _to_core(arguments[option.name])
        elif option.kind == "seed":
            value = arguments[option.name]  # a CUDA tensor is read by the kernels; a CPU one here
            value = value if value is None or value.is_cuda else int(value)
        else:
            value = arguments[option.name]
        if option.is_on(value):
            result[option.name] = value  # options left at their default are not passed: a shorter plan key
    return result


class _Op:
    """One custom op: its signature (and so its schema) from the options table, its real and fake
    implementations, and the names of its arguments for autograd."""

    def __init__(self, name, pass_, varlen, returns):
        self.pass_, self.varlen = pass_, varlen
        self.leading = ("dout", "q", "k", "v", "out", "lse") if pass_ == "bwd" else ("q", "k", "v")
        params = [_parameter(n, Tensor) for n in self.leading]
        if varlen:
            params += [_parameter("cu_seqlens_q", Tensor), _parameter("cu_seqlens_k", Tensor),
                       _parameter("max_seqlen_q", int), _parameter("max_seqlen_k", int)]
        params += [_parameter("softmax_scale", float), _parameter("causal", bool)] + _option_parameters(varlen)
        if pass_ == "bwd" and not varlen:
            params.append(_parameter("return_dbias", bool, False))
        self.signature = inspect.Signature(params, return_annotation=returns)
        self.names = list(self.signature.parameters)
        self.defaults = [p.default for p in params]
        self.required = sum(p.default is inspect.Parameter.empty for p in params)
        self.op = _define(name, self._with_signature(self.run), self._with_signature(self._fake))

    def _with_signature(self, method):
        def function(*args, **kwargs):
            return method(self.bind(*args, **kwargs))
        function.__signature__ = self.signature
        return function

    def bind(self, *args, **kwargs):
        if not kwargs and self.required <= len(args) <= len(self.names):
            # As the dispatcher calls: the arguments given, in order, up to the last one given.
            return dict(zip(self.names, (*args, *self.defaults[len(args):])))
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def run(self, a):
        """The op's implementation on its bound arguments."""
        results = self.compute(a)
        if self.pass_ == "bwd" and not self.varlen:
            # Custom ops cannot return an optional tensor: without return_dbias (or attn_bias) the
            # op's dbias is an empty (0,) tensor.
            return (*results[:3], a["q"].new_empty(0) if results[3] is None else results[3])
        return results

    def compute(self, a):
        """The op's results for its arguments: (out, lse), (dq, dk, dv), or for the dense backward
        (dq, dk, dv, dbias or None). A dense call on CUDA tensors runs its signature's resolved
        plans (as the drop-in's eager calls do), skipping the core's checks and plan lookup."""
        if not self.varlen and a["q"].is_cuda and (a["seed"] is None or not a["seed"].is_cuda):
            dropout_seed, bias = a["seed"], a[options.DIFFERENTIABLE]
            scalars = (a["softmax_scale"], a["causal"], a["dropout_p"], (a["window_left"], a["window_right"]),
                       a["softcap"], a["deterministic"])
            resolved = _resolution(a["q"], a["k"], a["v"], a["alibi_slopes"], bias, scalars)
            if resolved:
                # The ops run inside torch.compile's graphs, whose memory pools must not hold our
                # scratch across calls: no kept scratch (keep=False).
                if self.pass_ == "fwd":
                    return resolved.forward(a["q"], a["k"], a["v"], a["alibi_slopes"], bias, dropout_seed, keep=False)
                return resolved.backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], a["alibi_slopes"],
                                         bias, dropout_seed, a["return_dbias"], keep=False)
        return self.core(a)

    def core(self, a):
        """compute() through the core's public functions (which check every argument)."""
        varlen = self.varlen
        arrays = [_to_core(a[n]) for n in self.leading]
        if varlen:
            arrays += [_to_core(a["cu_seqlens_q"]), _to_core(a["cu_seqlens_k"]), a["max_seqlen_q"], a["max_seqlen_k"]]
        opts = _core_options(a, self.pass_, varlen)
        if self.pass_ == "fwd":
            function = api.flash_attn_varlen_func if varlen else api.flash_attn_func
            out, lse = function(*arrays, a["softmax_scale"], a["causal"], return_lse=True, **opts)
            return _from_core(out), _from_core(lse)
        if varlen:
            return tuple(_from_core(g) for g in api.flash_attn_varlen_backward(*arrays, a["softmax_scale"],
                                                                                a["causal"], **opts))
        grads = api.flash_attn_backward(*arrays, a["softmax_scale"], a["causal"], return_dbias=a["return_dbias"],
                                        **opts)
        return (*(_from_core(g) for g in grads[:3]), _from_core(grads[3]) if a["return_dbias"] else None)

    def _fake(self, a):
        q = a["q"]
        if self.pass_ == "fwd":
            stats = (q.shape[1], q.shape[0]) if self.varlen else (q.shape[0], q.shape[2], q.shape[1])
            return _empty(q), _empty(q, stats, _lse_dtype(q))
        grads = (_empty(q), _empty(a["k"]), _empty(a["v"]))
        if self.varlen:
            return grads
        bias = a[options.DIFFERENTIABLE]
        return (*grads, _empty(bias) if a["return_dbias"] and bias is not None else q.new_empty(0))


_forward = _Op("flash_attn_forward", "fwd", False, tuple[Tensor, Tensor])
_backward = _Op("flash_attn_backward", "bwd", False, tuple[Tensor, Tensor, Tensor, Tensor])
_varlen_forward = _Op("flash_attn_varlen_forward", "fwd", True, tuple[Tensor, Tensor])
_varlen_backward = _Op("flash_attn_varlen_backward", "bwd", True, tuple[Tensor, Tensor, Tensor])


# --------------------------------------------------------------------------------------------
# Autograd. The backward kernels have no term for a gradient of lse (flash_attn's lse has none
# either): marking it non-differentiable makes lse.requires_grad False, so a loss that uses it
# cannot be silently wrong. alibi_slopes get no gradient (as in flash_attn); attn_bias gets dbias
# when it requires grad (asked of the backward only then: it costs an extra accumulation).

class _Differentiable:
    """A forward op and its backward op as one differentiable function. Called eagerly on plain
    tensors it runs the ops' implementations under an autograd.Function (_Eager), without the
    dispatcher, whose custom-op layers cost more host time than the kernels of a small call; where
    torch.compile traces it, or functorch transforms or tensor subclasses (fake tensors) are about,
    it calls the custom op, whose registered autograd is this same save and gradient."""

    def __init__(self, forward, backward):
        self.forward, self.backward = forward, backward
        # What the backward needs of the forward's arguments, saved as tensors (then out and lse);
        # the op's other arguments are kept as they are. (The backward op takes the same names and
        # dout, out, lse, return_dbias.)
        self.tensors = [n for n in forward.names if n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
        self.tensors += [o.name for o in options.OPTIONS if o.kind in ("array", "seed") and o.name in forward.names]
        self.others = [n for n in forward.names if n not in self.tensors]
        self.takes_return_dbias = "return_dbias" in backward.names
        torch.library.register_autograd(forward.op, self._gradient_of_op, setup_context=self._save_op, lib=_LIBRARY)

    def __call__(self, arguments):
        """(out, lse) of the forward op's arguments (a dict with every one of them)."""
        q, k, v, bias = arguments["q"], arguments["k"], arguments["v"], arguments.get(options.DIFFERENTIABLE)
        if _eager(q, k, v, bias):
            if _needs_grad(q, k, v, bias):
                return _apply_eager(self, arguments, q, k, v, bias)
            return self.forward.compute(arguments)  # nothing to differentiate: no autograd node
        return self.forward.op(**arguments)

    def save(self, ctx, arguments, output):
        bias = arguments.get(options.DIFFERENTIABLE)
        ctx.return_dbias = bias is not None and bias.requires_grad
        ctx.save_for_backward(*[arguments[n] for n in self.tensors], *output)
        ctx.others = [arguments[n] for n in self.others]
        ctx.mark_non_differentiable(output[1])

    def _save_op(self, ctx, inputs, output):
        self.save(ctx, dict(zip(self.forward.names, inputs)), output)

    def backward_arguments(self, ctx, dout):
        *saved, out, lse = ctx.saved_tensors
        arguments = dict(zip(self.others, ctx.others))
        arguments.update(zip(self.tensors, saved))
        arguments.update(dout=dout, out=out, lse=lse)
        if self.takes_return_dbias:
            arguments["return_dbias"] = ctx.return_dbias
        return arguments

    def gradients(self, ctx, dout, run):
        """(dq, dk, dv, dbias or None) from the backward's implementation or op `run`."""
        grads = run(self.backward_arguments(ctx, dout))
        return (*grads[:3], grads[3] if ctx.return_dbias else None)  # varlen: no dbias

    def _gradient_of_op(self, ctx, dout, _dlse):
        by_name = dict(zip(("q", "k", "v", options.DIFFERENTIABLE), self.gradients(
            ctx, dout, lambda arguments: self.backward.op(**arguments))))
        return tuple(by_name.get(n) for n in self.forward.names)


class _Eager(torch.autograd.Function):
    """_Differentiable's eager path: the ops' implementations (_Op.run) with the ops' save and
    gradient. Its inputs are the tensors that can have gradients; the rest of the op's arguments
    travel in one dict (autograd's work per call grows with the inputs)."""

    @staticmethod
    def forward(ctx, differentiable, arguments, q, k, v, bias):
        output = differentiable.forward.run(arguments)
        differentiable.save(ctx, arguments, output)
        ctx.differentiable = differentiable
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        differentiable = ctx.differentiable
        return None, None, *differentiable.gradients(ctx, dout, differentiable.backward.compute)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _needs_grad(q, k, v, bias):
    """Whether an eager call needs an autograd node: grad mode on and a differentiable input that
    requires grad."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (bias is not None and bias.requires_grad))


def _eager(*tensors):
    """Whether a call may skip the dispatcher: not traced by torch.compile or a functorch transform,
    and its tensors plain ones (or None). (Without a Python loop: it runs on every call.)"""
    return _PLAIN_OR_NONE.issuperset(map(type, tensors)) and not _is_compiling() and not _transforming()


_PLAIN_OR_NONE = frozenset((*_PLAIN_TENSORS, type(None)))
_is_compiling, _transforming = torch.compiler.is_compiling, torch._C._are_functorch_transforms_active


_attention = _Differentiable(_forward, _backward)
_varlen_attention = _Differentiable(_varlen_forward, _varlen_backward)


def _bare_apply(function):
    """function.apply without torch's Python wrapper around it, which binds default arguments for
    a setup_context (the Functions here have none) and unwraps functorch's dead wrappers (eager
    calls take plain tensors, with no transform active): a few microseconds a call."""
    raw = vars(torch._C._FunctionBase).get("apply") if hasattr(torch._C, "_FunctionBase") else None
    return function.apply if raw is None else raw.__get__(None, function)


_apply_eager = _bare_apply(_Eager)


# --------------------------------------------------------------------------------------------
# Eager dense calls on CUDA tensors, resolved once per signature: the checks, the op arguments and
# the core's launch plans depend only on the tensors' layouts and the scalar options, so a
# repeated call finds them by one dictionary lookup and launches on its tensors' addresses.

_DENSE_SCALARS = ("softmax_scale", "causal", "dropout_p", "window_size", "softcap", "deterministic")


def _dense(q, k, v, alibi_slopes, attn_bias, scalars):
    """(out, lse) of a dense drop-in call; `scalars` are its _DENSE_SCALARS."""
    if _eager(q, k, v, alibi_slopes, attn_bias) and q is not None and q.is_cuda:
        resolved = _resolution(q, k, v, alibi_slopes, attn_bias, scalars)
        if resolved:
            result = resolved(q, k, v, alibi_slopes, attn_bias)
            if result is not None:
                return result
    return _attention(_op_arguments(dict(q=q, k=k, v=v), scalars[0], scalars[1],
                                    _dense_options(scalars, alibi_slopes, attn_bias)))


def _dense_options(scalars, alibi_slopes, attn_bias):
    """The options of a dense call by name, but the scale and causal."""
    return dict(zip(_DENSE_SCALARS[2:], scalars[2:]), alibi_slopes=alibi_slopes, attn_bias=attn_bias)


def _layout(t):
    return t.shape, t.stride(), t.dtype, t.get_device()


_resolved = {}  # signature -> _Resolved, or False where the call goes the ops' way


def _resolution(q, k, v, alibi_slopes, attn_bias, scalars):
    """The _Resolved of a call's signature (made and checked at its first call), False where its
    calls go the ops' way, None where the signature cannot be a key (an unhashable option, or a
    window_size that is not a pair)."""
    scale, causal, dropout_p, window, softcap, deterministic = scalars
    try:
        # Types too: causal=1 must still meet the bool check, a window of floats the int check.
        key = (scalars, *map(type, scalars), type(window[0]), type(window[1]), _config.forced_choices(), q.shape,
               q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype, k.get_device(), v.shape, v.stride(),
               v.dtype, v.get_device(), None if alibi_slopes is None else _layout(alibi_slopes),
               None if attn_bias is None else _layout(attn_bias))
        resolved = _resolved.get(key)
    except (TypeError, IndexError):
        return None
    if resolved is None:
        arguments = _checked_arguments(dict(q=q, k=k, v=v), scale, causal,
                                       _dense_options(scalars, alibi_slopes, attn_bias))
        resolved = _Resolved.of(arguments)
        if len(_resolved) >= 1024:
            _resolved.clear()
        _resolved[key] = resolved
    return resolved


class _Resolved:
    """A dense eager call signature worked out once: the op's checked arguments and the core's
    plans, the forward's and the backward's per layout of dout (made at the first backward).
    Where a plan cannot take a call's addresses (one not aligned as the kernels need) the call
    goes the ops' way, which copies."""

    def __init__(self, arguments, plan):
        # The arguments but their tensors, which each call brings (holding them would keep them alive).
        self.arguments = dict(arguments, q=None, k=None, v=None, alibi_slopes=None, attn_bias=None)
        self.plan, self.forward_positions = plan, _positions(plan, _FORWARD_INPUTS)
        self.dropout = bool(arguments["dropout_p"])
        self.with_arrays = arguments["alibi_slopes"] is not None or arguments["attn_bias"] is not None
        self.backward_plans = {}  # (dout's strides, return_dbias) -> (plan, its inputs' positions) or False

    @classmethod
    def of(cls, arguments):
        """The _Resolved of a checked call, or False where the core has no plan for it (a head dim
        that is not a multiple of 8) or a tensor is not contiguous in its last dimension."""
        tensors = [arguments[name] for name in ("q", "k", "v", "alibi_slopes", "attn_bias")]
        if any(t is not None and t.dim() and t.stride(-1) != 1 for t in tensors):
            return False
        plan = api.plan_of("fwd", dict(q=tensors[0], k=tensors[1], v=tensors[2]), arguments["softmax_scale"],
                           arguments["causal"], cls._core_options(arguments, "fwd"), "flash_attn_func")
        return cls(arguments, plan) if plan is not None else False

    @staticmethod
    def _core_options(arguments, pass_):
        """The core's options of a plan: a dropout seed as an int (its value is patched per call)."""
        given = _core_options(arguments, pass_, False)
        if arguments["dropout_p"]:
            given["seed"] = 0
        return given

    def __call__(self, q, k, v, alibi_slopes, attn_bias):
        """(out, lse), or None where the ops must run the call (dropout while a graph is captured:
        its seed is drawn on the device)."""
        seed = None
        if self.dropout:
            if torch.cuda.is_current_stream_capturing():
                return None
            seed = draw_dropout_seed()
        if _needs_grad(q, k, v, attn_bias):
            lse_out = []
            return _apply_resolved(self, seed, lse_out, alibi_slopes, q, k, v, attn_bias), lse_out[0]
        return self.forward(q, k, v, alibi_slopes, attn_bias, seed)

    def forward(self, q, k, v, alibi_slopes, attn_bias, seed, keep=True):
        """(out, lse); `keep`: Plan.call's (the eager calls keep their small scratch per stream)."""
        given = (q, k, v, alibi_slopes, attn_bias)
        result = self.plan.call([given[i] for i in self.forward_positions], None if seed is None else int(seed),
                                keep=keep)
        if result is None:
            result = _forward.core(dict(self.arguments, q=q, k=k, v=v, alibi_slopes=alibi_slopes,
                                        attn_bias=attn_bias, seed=seed))
        return result

    def backward(self, dout, q, k, v, out, lse, alibi_slopes, attn_bias, seed, return_dbias, keep=True):
        """(dq, dk, dv, dbias or None)."""
        stride = dout.stride()
        if stride[-1] != 1:
            dout = dout.contiguous()
            stride = dout.stride()
        given = (dout, q, k, v, out, lse, alibi_slopes, attn_bias)
        planned = self.backward_plans.get((stride, return_dbias))  # autograd gives dout out's shape, dtype, device
        if planned is None:
            arrays = {name: array for name, array in zip(_BACKWARD_INPUTS, given) if array is not None}
            core_options = self._core_options(dict(self.arguments, alibi_slopes=alibi_slopes, attn_bias=attn_bias),
                                              "bwd")
            plan = api.plan_of("bwd", arrays, self.arguments["softmax_scale"], self.arguments["causal"], core_options,
                               "flash_attn_backward", None, return_dbias)
            planned = self.backward_plans[stride, return_dbias] = plan and (plan, _positions(plan, _BACKWARD_INPUTS))
        grads = None
        if planned:
            plan, positions = planned
            grads = plan.call([given[i] for i in positions], None if seed is None else int(seed), keep=keep)
        if grads is None:
            grads = _backward.core(dict(self.arguments, dout=dout, q=q, k=k, v=v, out=out, lse=lse,
                                        alibi_slopes=alibi_slopes, attn_bias=attn_bias, seed=seed,
                                        return_dbias=return_dbias))
        return (*grads[:3], grads[3] if return_dbias else None)


_FORWARD_INPUTS = ("q", "k", "v", "alibi_slopes", "attn_bias")
_BACKWARD_INPUTS = ("dout", "q", "k", "v", "out", "lse", "alibi_slopes", "attn_bias")


def _positions(plan, names):
    """Where each of a plan's inputs (Plan.input_names) is among `names`, the order a resolved call
    holds its tensors in."""
    return [names.index(name) for name in plan.input_names]


class _ResolvedFunction(torch.autograd.Function):
    """A resolved call under autograd: its inputs are the tensors that can have gradients (and
    the ALiBi slopes, which have none). Its one output is out: lse, which has no gradient, comes
    back through `lse_out` (a list), which spares autograd a second output."""

    @staticmethod
    def forward(ctx, resolved, seed, lse_out, alibi_slopes, q, k, v, attn_bias):
        out, lse = resolved.forward(q, k, v, alibi_slopes, attn_bias, seed)
        lse_out.append(lse)
        if resolved.with_arrays:
            ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, attn_bias)
            ctx.return_dbias = attn_bias is not None and attn_bias.requires_grad
        else:
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.resolved, ctx.seed = resolved, seed
        return out

    @staticmethod
    def backward(ctx, dout):
        resolved = ctx.resolved
        if resolved.with_arrays:
            q, k, v, out, lse, alibi_slopes, attn_bias = ctx.saved_tensors
            return_dbias = ctx.return_dbias
        else:
            (q, k, v, out, lse), alibi_slopes, attn_bias, return_dbias = ctx.saved_tensors, None, None, False
        grads = resolved.backward(dout, q, k, v, out, lse, alibi_slopes, attn_bias, ctx.seed, return_dbias)
        return None, None, None, None, *grads


_apply_resolved = _bare_apply(_ResolvedFunction)


# --------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: a custom op that writes the caches in place (inference: no gradient).



def _numpy_view(t):
    """A NumPy array sharing a CPU tensor's memory (bfloat16 through its bits), so that the NumPy
    path's in-place writes land in the tensor."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16_dtype())
    return t.numpy()


def _kvcache_implementation(a):
    """The op's results for its bound arguments: (out, lse), the caches written in place."""
    caches = [a[name] if a[name].is_cuda else _numpy_view(a[name]) for name in ("k_cache", "v_cache")]
    given = {}
    for option in options.for_call("kvcache"):
        value = (tuple(a[part] for part in option.parts) if option.kind == "pair" else a[option.name])
        given[option.name] = _to_core(value) if option.kind == "array" else value
    out, lse = api.flash_attn_with_kvcache(
        _to_core(a["q"]), *caches, *(_to_core(a[name]) for name in validate.KVCACHE_ARRAYS),
        softmax_scale=a["softmax_scale"], causal=a["causal"], rotary_interleaved=a["rotary_interleaved"],
        num_splits=a["num_splits"], return_softmax_lse=True, **given)
    return _from_core(out), _from_core(lse)


def _kvcache_fake(a):
    q = a["q"]
    return _empty(q), _empty(q, (q.shape[0], q.shape[2], q.shape[1]), _lse_dtype(q))


def _kvcache_op():
    params = [_parameter(name, Tensor) for name in ("q", "k_cache", "v_cache")]
    params += [_parameter("softmax_scale", float), _parameter("causal", bool)]
    params += [_parameter(name, Optional[Tensor], None) for name in validate.KVCACHE_ARRAYS]
    params += _option_parameters(False, "kvcache")
    params += [_parameter("rotary_interleaved", bool, True), _parameter("num_splits", int, 0)]
    signature = inspect.Signature(params, return_annotation=tuple[Tensor, Tensor])

    def bound(method):
        def function(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs)
            arguments.apply_defaults()
            return method(arguments.arguments)
        function.__signature__ = signature
        return function
    return _define("flash_attn_with_kvcache", bound(_kvcache_implementation), bound(_kvcache_fake),
                   mutates_args=("k_cache", "v_cache"))


_kvcache = _kvcache_op()


# --------------------------------------------------------------------------------------------
# Drop-in functions with flash_attn's signatures.

_SEED_BOUND = 2 ** 63 - 1  # seeds are int64 tensors: keys in [0, 2**63 - 1)


def draw_dropout_seed():
    """The dropout seed the functions below draw for a call with dropout_p > 0: an int64 scalar CPU
    tensor, uniform in [0, 2**63 - 1), from torch's default CPU generator (so torch.manual_seed
    decides it; torch.cuda.manual_seed alone does not). It is the Philox key of the dropout mask
    (cupyflash.reference.dropout_keep_mask gives the mask of a seed). After torch.manual_seed(s),
    draw_dropout_seed() returns the seed that the next dropout call would use."""
    return torch.randint(0, _SEED_BOUND, (), dtype=torch.int64)


def _check_tensor(name, value):
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")


def _number(name, value):
    """value as a float for an op's float argument; the core checks its range."""
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, (int, float, numpy.number)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def _op_arguments(tensors, softmax_scale, causal, given, varlen=False):
    """The forward op's arguments from a drop-in call's: `tensors` (q, k, v and the varlen packing)
    and the options, checked here where the op's schema would give a less helpful message (the
    core checks the rest), and the dropout seed (_with_seed)."""
    return _with_seed(_checked_arguments(tensors, softmax_scale, causal, given, varlen))


def _checked_arguments(tensors, softmax_scale, causal, given, varlen=False):
    """_op_arguments without a seed. The checked scalars are cached per distinct call, since a
    model makes the same call many times."""
    for name in ("q", "k", "v"):
        if not isinstance(tensors[name], torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensors[name]).__name__}")
    q = tensors["q"]
    scalars = (varlen, q.shape[-1], softmax_scale, causal, *[given.get(n) for n in _SCALAR_OPTIONS])
    try:
        checked = _checked_scalars.get((tuple(type(x) for x in scalars), scalars))
    except TypeError:  # an unhashable value (a list window_size): checked afresh
        checked, scalars = None, None
    if checked is None:
        checked = _check_scalars(q, softmax_scale, causal, given, varlen)
        if scalars is not None and len(_checked_scalars) < 1024:
            _checked_scalars[tuple(type(x) for x in scalars), scalars] = checked
    arguments = dict(tensors, **checked)
    for option in options.OPTIONS:
        if option.kind == "array" and (option.varlen or not varlen):
            value = given.get(option.name)
            _check_tensor(option.name, value)
            arguments[option.name] = value
    return arguments


def _with_seed(arguments):
    """The arguments with the dropout seed of the call where dropout is on. It is drawn only then,
    so calls without it leave torch's generator alone, as flash_attn's do (flash_attn applies
    dropout whenever dropout_p > 0; modules pass 0.0 in eval mode). While a CUDA graph is captured
    it is drawn on the device, by torch's CUDA generator, so that every replay gets a new one."""
    if arguments["dropout_p"]:
        q = arguments["q"]
        arguments["seed"] = (torch.randint(0, _SEED_BOUND, (), dtype=torch.int64, device=q.device)
                             if q.is_cuda and torch.cuda.is_current_stream_capturing() else draw_dropout_seed())
    return arguments


_checked_scalars = {}
_SCALAR_OPTIONS = [o.name for o in options.OPTIONS if o.kind in ("pair", "real", "flag")]


def _check_scalars(q, softmax_scale, causal, given, varlen):
    """The scale, causal and the pair, real and flag options as the ops take them (and no seed)."""
    checked = dict(softmax_scale=validate.check_scale(softmax_scale, q.shape[-1]),
                   causal=validate.check_flag("causal", causal), seed=None)
    for option in options.OPTIONS:
        if varlen and not option.varlen:
            continue
        value = given.get(option.name, option.default)
        if option.kind == "pair":
            checked.update(zip(option.parts, options.window_bounds(False, value)))
        elif option.kind == "real":
            checked[option.name] = _number(option.name, value)
        elif option.kind == "flag":
            checked[option.name] = validate.check_flag(option.name, value)
    return checked


def _result(out, lse, return_attn_probs):
    # flash_attn returns (out, softmax_lse, S_dmask), S_dmask being the dropout pattern (in its
    # tests only). cupyflash never forms the probabilities or the mask, so the third is None;
    # the mask of a seed is cupyflash.reference.dropout_keep_mask.
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, attn_bias=None):
    """flash_attn.flash_attn_func: q (batch, seqlen_q, nheads, headdim), k and v
    (batch, seqlen_k, nheads_k, headdim); returns out like q, or (out, lse, None) with
    return_attn_probs. Differentiable in q, k, v (and attn_bias); lse is not (and is -inf, not
    flash_attn's +inf, for a row that sees no key).

    Options as in flash_attn: dropout_p (its seed is drawn by draw_dropout_seed), window_size,
    softcap, alibi_slopes (float32 (nheads,) or (batch, nheads), no gradient), deterministic (the
    backward adds dq in a fixed order). cupyflash's own: attn_bias, an additive score bias
    broadcastable from (batch or 1, nheads or 1, seqlen_q or 1, seqlen_k), float32 or q's dtype, added
    after softcap and with ALiBi; its gradient is computed when it requires grad.
    """
    out, lse = _dense(q, k, v, alibi_slopes, attn_bias,
                      (softmax_scale, causal, dropout_p, window_size, softcap, deterministic))
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              attn_bias=None):
    """flash_attn.flash_attn_qkvpacked_func: qkv is (batch, seqlen, 3, nheads, headdim); q, k, v are
    views of it (no copies)."""
    validate.check_packed("qkv", qkv, 5, 3)
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             attn_bias=None):
    """flash_attn.flash_attn_kvpacked_func: kv is (batch, seqlen_k, 2, nheads_k, headdim)."""
    validate.check_packed("kv", kv, 5, 2)
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash_attn.flash_attn_varlen_func: sequences of different lengths packed without padding.

    q is (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim); sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v
    (int32 tensors of length batch + 1 on q's device); max_seqlen_q and max_seqlen_k are ints at
    least every length. Returns out like q, or (out, lse, None) with lse (nheads, total_q).
    Options as in flash_attn_func (alibi_slopes (nheads,) or (batch, nheads)); masks and ALiBi are
    per sequence, aligned to its own bottom-right corner. The cu_seqlens are checked on the host
    (for CUDA tensors that waits for them; a tensor that passed, again only after torch writes it).
    With block_table (int32 (batch, pages per sequence)), k and v are a paged cache (num_blocks,
    page_size, nheads_k, headdim) (prefill from a paged cache, cupyflash.flash_attn_varlen_func has the
    semantics): its keys are gathered into packed tensors by torch indexing on the caches' device
    (_packed_from_pages), so gradients reach the caches, and the call compiles whole under torch.compile
    and captures in a CUDA graph; the table's values are checked on the host where the lengths are (not
    when compiling or capturing, nor under cupyflash.no_host_sync, where a block outside the cache reads
    a clamped one).
    """
    for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(value).__name__}")
    if block_table is not None:
        for name, value in (("q", q), ("k", k), ("v", v), ("block_table", block_table)):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes = _packed_from_pages(
            q, k, v, validate.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), block_table, alibi_slopes)
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k)
    arguments = _op_arguments(tensors, softmax_scale, causal, dict(
        dropout_p=dropout_p, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic), varlen=True)
    out, lse = _varlen_attention(arguments)
    return _result(out, lse, return_attn_probs)


def _packed_from_pages(q, k_cache, v_cache, varlen, block_table, alibi_slopes):
    """(k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes) of a varlen call over a paged cache, gathered
    by torch indexing on the caches' device (_paged.packed_from_pages: a size that does not depend on
    the values, so torch.compile traces it whole); the values are checked where the call may read them."""
    validate.check_paged_varlen_shapes(q, k_cache, v_cache, varlen, block_table)
    for name, tensor in (("q", q), ("v", v_cache), ("cu_seqlens_q", varlen.cu_seqlens_q),
                         ("cu_seqlens_k", varlen.cu_seqlens_k), ("block_table", block_table)):
        if tensor.device != k_cache.device:
            raise ValueError(f"{name} is on {tensor.device} but k (the paged cache) is on {k_cache.device}; "
                             f"pass tensors on one device")
    if not _is_compiling() and (not k_cache.is_cuda or not (validate.host_sync_off()
                                                            or torch.cuda.is_current_stream_capturing())):
        validate.check_paged_varlen_values(varlen.cu_seqlens_k.cpu().numpy(), block_table.cpu().numpy(), k_cache)
    return _paged.packed_from_pages(_paged.TorchCalls(k_cache.device), k_cache, v_cache, varlen, block_table,
                                    alibi_slopes)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash_attn.flash_attn_with_kvcache: attention of q over the caches after appending k and v
    to them in place (cupyflash.flash_attn_with_kvcache has the semantics). A custom op that
    declares the caches it writes, so torch.compile keeps the writes (eager CUDA calls skip it and run
    the core directly); no gradient. CPU tensors run the NumPy reference, CUDA tensors the KV-cache
    kernels (cupyflash/_kvcache.py)."""
    for name, value in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    tensors = dict(k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                   cache_leftpad=cache_leftpad, block_table=block_table, alibi_slopes=alibi_slopes)
    for name, value in tensors.items():
        _check_tensor(name, value)
    given = [t for t in (q, k_cache, v_cache, *tensors.values(), cache_seqlens) if isinstance(t, torch.Tensor)]
    if q.is_cuda and _eager(*given):
        # Eager: the core directly (the custom op's dispatch costs more than the kernels of a decode
        # step); the caches' version counters move as the op's declared writes would move them.
        result = api.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                             cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                             window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                             return_softmax_lse)
        for cache in (k_cache, v_cache):
            if not cache.is_inference():  # (inference tensors have no version counter)
                torch.autograd.graph.increment_version(cache)
        return result
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), validate.check_seqlens_int(cache_seqlens), dtype=torch.int32,
                                   device=q.device)
    left, right = options.window_bounds(False, window_size)
    out, lse = _kvcache(q, k_cache, v_cache, validate.check_scale(softmax_scale, q.shape[-1]),
                        validate.check_flag("causal", causal), k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                        block_table=block_table, window_left=left, window_right=right,
                        softcap=_number("softcap", softcap), alibi_slopes=alibi_slopes,
                        rotary_interleaved=validate.check_flag("rotary_interleaved", rotary_interleaved),
                        num_splits=validate.check_num_splits(num_splits))
    return (out, lse) if validate.check_flag("return_softmax_lse", return_softmax_lse) else out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn.flash_attn_varlen_qkvpacked_func: qkv is (total, 3, nheads, headdim); q, k, v are
    views of it, and cu_seqlens and max_seqlen serve both sides."""
    validate.check_packed("qkv", qkv, 4, 3)
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_varlen_kvpacked_func: kv is (total_k, 2, nheads_k, headdim)."""
    validate.check_packed("kv", kv, 4, 2)
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


from .torch_ring import ring_flash_attn_func, shard_sequence, unshard_sequence  # noqa: E402,F401  (context parallelism)
