"""Times candidate tiles for the tile table (`cupyflash/_config.py`), bf16, 16k tokens, hidden 2048.

Usage: python bench/tiles.py            # every candidate below, seqlen 4096, causal and not
(the candidates of earlier rounds and their timings are in the comments of _config.py)
Each candidate compiled with zero spills (see `python -m cupyflash check --compile --verbose`).
Prints TFLOP/s (FLOPs as in ../shared/peers/README.md), timed as `python -m cupyflash bench` times.
"""

import cupyflash
from cupyflash import _config, _plan

CANDIDATES = {  # (block_m, block_n, warps, stages): the fourth session's round
    ("fwd", 128): [(128, 32, 4, 1), (128, 64, 8, 1), (64, 64, 4, 1)],
    ("fwd", 256): [(64, 64, 4, 1), (128, 64, 8, 1), (64, 32, 4, 1)],
    ("fwd", 64): [(128, 64, 4, 1), (128, 128, 8, 1)],
}


def inputs(seqlen, hd):
    """Fresh bf16 (q, k, v, dout) of the benchmark's shape: 16k tokens, hidden 2048."""
    import torch
    batch, nheads = 16384 // seqlen, 2048 // hd
    return [torch.randn(batch, seqlen, nheads, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4)]


def tflops(pass_, tensors, causal):
    """TFLOP/s of cupyflash's `pass_` ('fwd' or 'bwd') on `tensors`, timed as the benchmark times."""
    from cupyflash.benchmark import attention_flops, time_ms
    q, k, v, do = tensors
    batch, seqlen, nheads, hd = q.shape
    flops = attention_flops(batch, nheads, seqlen, hd, causal, pass_)
    out, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    if pass_ == "fwd":
        ms = time_ms(lambda: cupyflash.flash_attn_func(q, k, v, causal=causal))
    else:
        ms = time_ms(lambda: cupyflash.flash_attn_backward(do, q, k, v, out, lse, causal=causal))
    return flops / ms / 1e9


def main(seqlen=4096):
    table = _config.TILES[_config.MMA_SYNC]["sm90"]
    print(f"{'pass':4} {'hd':>4} {'tile':>14} | {'TFLOP/s':>8} {'causal':>8}")
    for (pass_, hd), candidates in CANDIDATES.items():
        tensors = inputs(seqlen, hd)
        original = table[pass_][hd]
        for tile in candidates:
            table[pass_][hd] = tile
            _plan._plans.clear()  # cached launch plans hold the previous tile
            row = [tflops(pass_, tensors, causal) for causal in (False, True)]
            print(f"{pass_:4} {hd:4d} {str(tile):>14} | {row[0]:8.1f} {row[1]:8.1f}", flush=True)
        table[pass_][hd] = original


if __name__ == "__main__":
    main()
