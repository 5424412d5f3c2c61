"""cupyflash: exact FlashAttention (forward and backward) on CuPy raw kernels, for CuPy, PyTorch and JAX."""

from .api import (flash_attn_backward, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_backward, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .validate import no_host_sync

__all__ = ["flash_attn_func", "flash_attn_backward", "flash_attn_varlen_func", "flash_attn_varlen_backward",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "no_host_sync"]
__version__ = "0.1.0"
