"""PyTorch: cupyflash as torch custom ops, with fake tensors, autograd and torch.compile, and a
drop-in for flash_attn's functions:

    from cupyflash.torch import flash_attn_func   # was: from flash_attn import flash_attn_func

CUDA tensors run the kernels on torch's current stream, with outputs from torch's allocator. CPU
tensors run the NumPy float64 reference (slow; it lets opcheck, autograd and torch.compile be
tested without a GPU).
"""

import numpy
import torch

from . import interface
from ._arrays import bfloat16_dtype

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"cupyflash.torch needs PyTorch 2.4 or newer (torch.library.custom_op); found {torch.__version__}")

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func"]


# --------------------------------------------------------------------------------------------
# Tensors to and from the core: CUDA tensors go as they are, CPU tensors as NumPy arrays.

def _to_core(t):
    t = t.detach()  # .numpy() and DLPack refuse tensors that require grad
    if t.stride(-1) != 1:
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


# --------------------------------------------------------------------------------------------
# The custom ops. softmax_scale is always a number here: the Python functions resolve None.

@torch.library.custom_op("cupyflash::flash_attn_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = interface.flash_attn_func(_to_core(q), _to_core(k), _to_core(v), softmax_scale, causal,
                                         return_lse=True)
    return _from_core(out), _from_core(lse)


@_forward.register_fake
def _(q, k, v, softmax_scale, causal):
    batch, seqlen_q, nheads, _ = q.shape
    return _empty(q), _empty(q, (batch, nheads, seqlen_q), torch.float32)


@torch.library.custom_op("cupyflash::flash_attn_backward", mutates_args=())
def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # dout is often not contiguous (sum().backward() gives an expanded tensor); _to_core copies it then.
    grads = interface.flash_attn_backward(*(_to_core(t) for t in (dout, q, k, v, out, lse)), softmax_scale, causal)
    return tuple(_from_core(g) for g in grads)


@_backward.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal):
    return _empty(q), _empty(k), _empty(v)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.softmax_scale, ctx.causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    # The backward kernels have no term for a gradient of lse (flash_attn's lse has none either):
    # marking it makes lse.requires_grad False, so a loss that uses it cannot be silently wrong.
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, dout, _dlse):
    dq, dk, dv = _backward(dout, *ctx.saved_tensors, ctx.softmax_scale, ctx.causal)
    return dq, dk, dv, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Drop-in functions with flash_attn's signatures.

# flash_attn options the kernels do not have yet: name -> (the value that means "off", what it is).
# A value other than "off" raises; never ignored. When the core gains one, delete its line here
# and pass it on in _attention (and through the custom ops).
_NOT_YET = {
    "dropout_p": (0.0, "attention dropout"),
    "window_size": ((-1, -1), "sliding-window (local) attention"),
    "softcap": (0.0, "softcapping of the scores"),
    "alibi_slopes": (None, "ALiBi biases"),
    "deterministic": (False, "a deterministic backward (dq is summed with float32 atomics)"),
}


def _is_off(value, off):
    if off is None:
        return value is None
    if isinstance(off, tuple):
        return isinstance(value, (tuple, list)) and tuple(value) == off
    return not isinstance(value, torch.Tensor) and value == off


def _attention(q, k, v, softmax_scale, causal, return_attn_probs, options):
    for name, value in options.items():
        off, what = _NOT_YET[name]
        if not _is_off(value, off):
            raise NotImplementedError(f"cupyflash has no {what} yet: got {name}={value!r}; "
                                      f"only {name}={off!r} is supported")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out, lse = _forward(q, k, v, float(softmax_scale), bool(causal))
    # flash_attn returns (out, softmax_lse, S_dmask), S_dmask being the dropout pattern. cupyflash
    # has no dropout and never forms the probabilities, so the third is None.
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_func: q (batch, seqlen_q, nheads, headdim), k and v
    (batch, seqlen_k, nheads_k, headdim); returns out like q, or (out, lse, None) with
    return_attn_probs. Differentiable in q, k, v; lse is not (and is -inf, not flash_attn's +inf,
    for a row that sees no key). Options cupyflash lacks raise NotImplementedError unless left at
    their defaults."""
    return _attention(q, k, v, softmax_scale, causal, return_attn_probs,
                      dict(dropout_p=dropout_p, window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, deterministic=deterministic))


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_qkvpacked_func: qkv is (batch, seqlen, 3, nheads, headdim)."""
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn.flash_attn_kvpacked_func: kv is (batch, seqlen_k, 2, nheads_k, headdim)."""
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(*args, **kwargs):
    """Not available yet: cupyflash has no variable-length (cu_seqlens) kernels. Importable so
    that a module importing it alongside flash_attn_func loads; calling it raises."""
    raise NotImplementedError("cupyflash has no variable-length kernels yet, so flash_attn_varlen_func is "
                              "not available (padding would change what the keys see, so it is not faked)")
