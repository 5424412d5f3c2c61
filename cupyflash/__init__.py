"""cupyflash: exact FlashAttention (forward and backward) on CuPy raw kernels, for CuPy, PyTorch and JAX."""

from .interface import flash_attn_backward, flash_attn_func

__all__ = ["flash_attn_func", "flash_attn_backward"]
__version__ = "0.1.0"
