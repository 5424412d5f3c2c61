# Bias-tiles forwards and backwards per head dim (full rows and one broadcast row), under compute-sanitizer.
import cupy
import cupyflash
from cupyflash import _plan
for hd, sq, sk, causal, rows in ((64, 200, 136, True, True), (128, 113, 200, False, True), (256, 300, 8, False, True),
                                 (64, 200, 136, False, False), (128, 113, 200, True, False), (256, 300, 8, False, False)):
    _plan._plans.clear()
    q = cupy.random.standard_normal((2, sq, 4, hd), dtype=cupy.float32).astype(cupy.float16)
    k = cupy.random.standard_normal((2, sk, 2, hd), dtype=cupy.float32).astype(cupy.float16)
    v = cupy.random.standard_normal((2, sk, 2, hd), dtype=cupy.float32).astype(cupy.float16)
    bias = cupy.random.standard_normal((2, 1, sq if rows else 1, sk), dtype=cupy.float32).astype(cupy.float16)
    out, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, attn_bias=bias, return_lse=True)
    cupyflash.flash_attn_backward(out, q, k, v, out, lse, causal=causal, attn_bias=bias, return_dbias=True)
    cupy.cuda.Device().synchronize()
    boxes = [(kk.pass_, int(p.params["bias_box_rows"][0])) for p in _plan._plans.values() for kk in p.kernels
             if kk.pass_ in ("fwd", "bwd")]
    print(hd, "rows" if rows else "one row", "bias_box_rows", boxes, "nan" if bool(cupy.isnan(out).any()) else "ok")
