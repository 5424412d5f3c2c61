"""Times candidate tiles for the tile table (`cupyflash/_config.py`), bf16, 16k tokens, hidden 2048.

Usage: python bench/tiles.py            # every candidate below, seqlen 4096, causal and not
(the candidates of earlier rounds and their timings are in the comments of _config.py)
Each candidate compiled with zero spills (see `python -m cupyflash check --compile --verbose`).
Prints TFLOP/s (FLOPs as in ../shared/peers/README.md), timed as `python -m cupyflash bench` times.
"""

import cupyflash
from cupyflash import _config, interface

CANDIDATES = {  # (block_m, block_n, warps, stages)
    ("fwd", 64): [(128, 64, 4, 1), (128, 32, 4, 1)],
    ("fwd", 96): [(64, 64, 4, 1), (128, 32, 4, 1)],
    ("fwd", 256): [(64, 64, 4, 1), (64, 32, 4, 1)],
}


def main(seqlen=4096):
    import torch
    from cupyflash.benchmark import time_ms as median_ms
    table = _config.TILES["sm90"]
    print(f"{'pass':4} {'hd':>4} {'tile':>14} | {'TFLOP/s':>8} {'causal':>8}")
    for (pass_, hd), candidates in CANDIDATES.items():
        batch, nheads = 16384 // seqlen, 2048 // hd
        q, k, v, do = (torch.randn(batch, seqlen, nheads, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        original = table[pass_][hd]
        for tile in candidates:
            table[pass_][hd] = tile
            interface._plans.clear()  # cached launch plans hold the previous tile
            row = []
            for causal in (False, True):
                flops = 4 * batch * nheads * seqlen ** 2 * hd / (2 if causal else 1) * (2.5 if pass_ == "bwd" else 1)
                out, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
                if pass_ == "fwd":
                    ms = median_ms(lambda: cupyflash.flash_attn_func(q, k, v, causal=causal))
                else:
                    ms = median_ms(lambda: cupyflash.flash_attn_backward(do, q, k, v, out, lse, causal=causal))
                row.append(flops / ms / 1e9)
            print(f"{pass_:4} {hd:4d} {str(tile):>14} | {row[0]:8.1f} {row[1]:8.1f}", flush=True)
        table[pass_][hd] = original


if __name__ == "__main__":
    main()
