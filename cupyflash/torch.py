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
"""

from typing import Optional

import numpy
import torch

from . import interface, reference
from ._arrays import bfloat16_dtype

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"cupyflash.torch needs PyTorch 2.4 or newer (torch.library.custom_op); found {torch.__version__}")

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "draw_dropout_seed"]

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------
# Tensors to and from the core: CUDA tensors go as they are, CPU tensors as NumPy arrays.

def _to_core(t):
    if t is None:
        return None
    t = t.detach()  # .numpy() and DLPack refuse tensors that require grad
    if t.dim() and t.stride(-1) != 1:
        t = t.contiguous()  # the kernels read whole head-dim rows; flash_attn copies such inputs too
    if t.device.type != "cpu":
        return t
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16 of torch's; float32 holds its values exactly
        return t.float().numpy().astype(bfloat16_dtype())
    return t.numpy()


def _from_core(x):
    if isinstance(x, torch.Tensor):
        return x
    if x.dtype == bfloat16_dtype():
        return torch.from_numpy(numpy.ascontiguousarray(x, dtype=numpy.float32)).to(torch.bfloat16)
    return torch.from_numpy(numpy.ascontiguousarray(x))  # contiguous, like the fake tensors below


def _empty(like, shape=None, dtype=None):
    """A contiguous tensor, as the real implementations return (the fake ones must match strides)."""
    return torch.empty(like.shape if shape is None else shape, dtype=dtype or like.dtype, device=like.device)


def _options(window_left, window_right, softcap, alibi_slopes, dropout_p, seed):
    """The core's keyword options from the ops' arguments (the seed tensor read as an int)."""
    return dict(window_size=(window_left, window_right), softcap=softcap, alibi_slopes=_to_core(alibi_slopes),
                dropout_p=dropout_p, seed=None if seed is None else int(seed))


# --------------------------------------------------------------------------------------------
# The custom ops. softmax_scale is always a number here: the Python functions resolve None.
# Options default to "off", so calls written for the first versions of the ops still work.
# `deterministic` is an argument of the forward ops only so that their autograd formula can pass
# it to the backward op; the forward ignores it. `seed` is an int64 scalar tensor (any device;
# read on the host), needed when dropout_p > 0.

@torch.library.custom_op("cupyflash::flash_attn_forward", mutates_args=())
def _forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int = -1,
             window_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
             attn_bias: Optional[Tensor] = None, dropout_p: float = 0.0, seed: Optional[Tensor] = None,
             deterministic: bool = False) -> tuple[Tensor, Tensor]:
    out, lse = interface.flash_attn_func(
        _to_core(q), _to_core(k), _to_core(v), softmax_scale, causal, attn_bias=_to_core(attn_bias),
        return_lse=True, **_options(window_left, window_right, softcap, alibi_slopes, dropout_p, seed))
    return _from_core(out), _from_core(lse)


@_forward.register_fake
def _(q, k, v, softmax_scale, causal, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
      attn_bias=None, dropout_p=0.0, seed=None, deterministic=False):
    batch, seqlen_q, nheads, _ = q.shape
    return _empty(q), _empty(q, (batch, nheads, seqlen_q), torch.float32)


@torch.library.custom_op("cupyflash::flash_attn_backward", mutates_args=())
def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
              causal: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
              alibi_slopes: Optional[Tensor] = None, attn_bias: Optional[Tensor] = None, dropout_p: float = 0.0,
              seed: Optional[Tensor] = None, deterministic: bool = False,
              return_dbias: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbias); dbias is attn_bias's gradient, in its shape and dtype, with return_dbias
    (custom ops cannot return an optional tensor: without return_dbias it is an empty (0,) tensor)."""
    # dout is often not contiguous (sum().backward() gives an expanded tensor); _to_core copies it then.
    grads = interface.flash_attn_backward(
        *(_to_core(t) for t in (dout, q, k, v, out, lse)), softmax_scale, causal, attn_bias=_to_core(attn_bias),
        deterministic=deterministic, return_dbias=return_dbias,
        **_options(window_left, window_right, softcap, alibi_slopes, dropout_p, seed))
    dbias = grads[3] if return_dbias else None
    return (*(_from_core(g) for g in grads[:3]), q.new_empty(0) if dbias is None else _from_core(dbias))


@_backward.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left=-1, window_right=-1, softcap=0.0,
      alibi_slopes=None, attn_bias=None, dropout_p=0.0, seed=None, deterministic=False, return_dbias=False):
    dbias = _empty(attn_bias) if return_dbias and attn_bias is not None else q.new_empty(0)
    return _empty(q), _empty(k), _empty(v), dbias


@torch.library.custom_op("cupyflash::flash_attn_varlen_forward", mutates_args=())
def _varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int = -1,
                    window_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                    dropout_p: float = 0.0, seed: Optional[Tensor] = None,
                    deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) of packed sequences: out like q (total_q, nheads, headdim), lse (nheads, total_q)."""
    out, lse = interface.flash_attn_varlen_func(
        _to_core(q), _to_core(k), _to_core(v), _to_core(cu_seqlens_q), _to_core(cu_seqlens_k), max_seqlen_q,
        max_seqlen_k, softmax_scale, causal, return_lse=True,
        **_options(window_left, window_right, softcap, alibi_slopes, dropout_p, seed))
    return _from_core(out), _from_core(lse)


@_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left=-1,
      window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, deterministic=False):
    total_q, nheads, _ = q.shape
    return _empty(q), _empty(q, (nheads, total_q), torch.float32)


@torch.library.custom_op("cupyflash::flash_attn_varlen_backward", mutates_args=())
def _varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
                     window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                     alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0, seed: Optional[Tensor] = None,
                     deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    grads = interface.flash_attn_varlen_backward(
        *(_to_core(t) for t in (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)), max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, deterministic=deterministic,
        **_options(window_left, window_right, softcap, alibi_slopes, dropout_p, seed))
    return tuple(_from_core(g) for g in grads)


@_varlen_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None,
      deterministic=False):
    return _empty(q), _empty(k), _empty(v)


# --------------------------------------------------------------------------------------------
# Autograd. The backward kernels have no term for a gradient of lse (flash_attn's lse has none
# either): marking it non-differentiable makes lse.requires_grad False, so a loss that uses it
# cannot be silently wrong. alibi_slopes get no gradient (as in flash_attn); attn_bias gets dbias
# when it requires grad (asked of the backward only then: it costs an extra accumulation).

# The arguments of the forward ops after q, k, v (and the varlen packing), in schema order.
_OPTION_NAMES = ("softmax_scale", "causal", "window_left", "window_right", "softcap", "alibi_slopes", "attn_bias",
                 "dropout_p", "seed", "deterministic")
_VARLEN_OPTION_NAMES = tuple(n for n in _OPTION_NAMES if n != "attn_bias")


def _save(ctx, tensors, options):
    """Saves the forward's tensors (q, k, v, out, lse and the packing) and its options for the backward."""
    options = dict(options)
    ctx.tensor_options = [name for name in ("alibi_slopes", "attn_bias", "seed") if name in options]
    ctx.save_for_backward(*tensors, *(options.pop(name) for name in ctx.tensor_options))
    ctx.options = options


def _saved(ctx, count):
    """(the first `count` saved tensors, the options with the saved option tensors put back)."""
    saved = ctx.saved_tensors
    return saved[:count], dict(ctx.options, **dict(zip(ctx.tensor_options, saved[count:])))


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    options = dict(zip(_OPTION_NAMES, rest))
    bias = options["attn_bias"]
    ctx.return_dbias = bias is not None and bias.requires_grad
    out, lse = output
    _save(ctx, (q, k, v, out, lse), options)
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, dout, _dlse):
    tensors, options = _saved(ctx, 5)
    dq, dk, dv, dbias = _backward(dout, *tensors, **options, return_dbias=ctx.return_dbias)
    # One gradient per forward argument: q, k, v, then the options (all None but attn_bias's).
    return dq, dk, dv, *(dbias if name == "attn_bias" and ctx.return_dbias else None for name in _OPTION_NAMES)


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *rest = inputs
    out, lse = output
    _save(ctx, (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k), dict(zip(_VARLEN_OPTION_NAMES, rest)))
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.mark_non_differentiable(lse)


def _varlen_autograd_backward(ctx, dout, _dlse):
    tensors, options = _saved(ctx, 7)
    dq, dk, dv = _varlen_backward(dout, *tensors, *ctx.max_seqlens, **options)
    return dq, dk, dv, *(None for _ in range(4 + len(_VARLEN_OPTION_NAMES)))


_varlen_forward.register_autograd(_varlen_autograd_backward, setup_context=_varlen_setup_context)


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


def _op_options(q, softmax_scale, causal, dropout_p, window_size, softcap, alibi_slopes, deterministic):
    """The ops' option arguments from a drop-in call's (checked here where the op's schema would
    give a less helpful message; the core checks the rest)."""
    _check_tensor("alibi_slopes", alibi_slopes)
    left, right = reference.window_bounds(False, window_size)  # a pair of ints >= -1
    deterministic = interface._check_flag("deterministic", deterministic)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    dropout_p, softcap = _number("dropout_p", dropout_p), _number("softcap", softcap)
    # flash_attn applies dropout whenever dropout_p > 0 (modules pass 0.0 in eval mode). A seed is
    # drawn only then, so calls without dropout leave torch's generator alone, as flash_attn's do.
    seed = draw_dropout_seed() if dropout_p > 0 else None
    return dict(softmax_scale=float(softmax_scale), causal=bool(causal), window_left=left, window_right=right,
                softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                deterministic=deterministic)


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
    broadcastable from (batch or 1, nheads or 1, seqlen_q, seqlen_k), float32 or q's dtype, added
    after softcap and with ALiBi; its gradient is computed when it requires grad.
    """
    _check_tensor("attn_bias", attn_bias)
    options = _op_options(q, softmax_scale, causal, dropout_p, window_size, softcap, alibi_slopes, deterministic)
    out, lse = _forward(q, k, v, attn_bias=attn_bias, **options)
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              attn_bias=None):
    """flash_attn.flash_attn_qkvpacked_func: qkv is (batch, seqlen, 3, nheads, headdim); q, k, v are
    views of it (no copies)."""
    interface._check_packed("qkv", qkv, 5, 3)
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             attn_bias=None):
    """flash_attn.flash_attn_kvpacked_func: kv is (batch, seqlen_k, 2, nheads_k, headdim)."""
    interface._check_packed("kv", kv, 5, 2)
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
    (for CUDA tensors that waits for them). block_table (paged KV cache) is not supported.
    """
    if block_table is not None:
        raise NotImplementedError("cupyflash has no paged KV cache: block_table must be None, got a "
                                  f"{type(block_table).__name__}")
    for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(value).__name__}")
    options = _op_options(q, softmax_scale, causal, dropout_p, window_size, softcap, alibi_slopes, deterministic)
    out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options)
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn.flash_attn_varlen_qkvpacked_func: qkv is (total, 3, nheads, headdim); q, k, v are
    views of it, and cu_seqlens and max_seqlen serve both sides."""
    interface._check_packed("qkv", qkv, 4, 3)
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_varlen_kvpacked_func: kv is (total_k, 2, nheads_k, headdim)."""
    interface._check_packed("kv", kv, 4, 2)
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
