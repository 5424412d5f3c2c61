"""cupyflash: exact FlashAttention (forward and backward) on CuPy raw kernels, for CuPy, PyTorch and JAX."""

from .api import (flash_attn_backward, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_backward, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func)

__all__ = ["flash_attn_func", "flash_attn_backward", "flash_attn_varlen_func", "flash_attn_varlen_backward",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func"]
__version__ = "0.1.0"
