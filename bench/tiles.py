"""Times candidate tiles for the tile table (`cupyflash/_config.py`), bf16, 16k tokens, hidden 2048.

Usage: python bench/tiles.py [SEQLEN ...]   # every candidate below, seqlen 4096 by default, causal and not
(the earlier rounds' candidates and timings are in bench/notes/). A candidate is timed with each of
its table's TABLE_OPTIONS (a 'bwd_options' one with softcap and with ALiBi); a 'bwd' row, the plain
backward, is the options' baseline. Run with CUPYFLASH_FAMILY=mma_sync on sm_90 for the mma.sync tables.
Each candidate compiled with zero spills (see `python -m cupyflash check --compile --verbose`).
Prints TFLOP/s (FLOPs as in ../shared/peers/README.md), timed as `python -m cupyflash bench` times.
"""

import cupyflash
from cupyflash import _config, _plan

CANDIDATES = {  # (table, head dim): [(block_m, block_n, warps, stages), ...], the table's entry first
    ("bwd", 64): [(128, 128, 8, 2)],
    ("bwd_options", 64): [(128, 64, 8, 2), (64, 128, 8, 2)],
    ("bwd_options", 96): [(64, 64, 8, 2), (128, 64, 8, 2)],
    ("bwd", 128): [(64, 128, 8, 2)],
    ("bwd_options", 128): [(64, 64, 8, 2), (128, 64, 8, 2), (128, 64, 8, 1), (128, 32, 8, 2)],
    ("bwd", 256): [(64, 64, 8, 2)],
    ("bwd_options", 256): [(64, 32, 8, 1), (128, 32, 8, 1)],
}
TABLE_OPTIONS = {"bwd_options": [dict(softcap=30.0), "alibi"], "bwd": [{}]}


def option_sets(name, nheads):
    """The option keyword sets a candidate of table `name` is timed with ("alibi": slopes for nheads)."""
    import torch
    for options in TABLE_OPTIONS.get(name, [{}]):
        if options == "alibi":
            options = dict(alibi_slopes=torch.rand(nheads, device="cuda", dtype=torch.float32))
        yield options


def inputs(seqlen, hd):
    """Fresh bf16 (q, k, v, dout) of the benchmark's shape: 16k tokens, hidden 2048."""
    import torch
    batch, nheads = 16384 // seqlen, 2048 // hd
    return [torch.randn(batch, seqlen, nheads, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4)]


def tflops(pass_, tensors, causal, **options):
    """TFLOP/s of cupyflash's `pass_` ('fwd' or 'bwd') on `tensors` with `options`, timed as the benchmark times."""
    from cupyflash.benchmark import attention_flops, time_ms
    q, k, v, do = tensors
    batch, seqlen, nheads, hd = q.shape
    flops = attention_flops(batch, nheads, seqlen, hd, causal, pass_)
    out, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, **options)
    if pass_ == "fwd":
        ms = time_ms(lambda: cupyflash.flash_attn_func(q, k, v, causal=causal, **options))
    else:
        ms = time_ms(lambda: cupyflash.flash_attn_backward(do, q, k, v, out, lse, causal=causal, **options))
    return flops / ms / 1e9


def main(seqlen=4096):
    table = _config.TILES[_config.MMA_SYNC]["sm90"]
    print(f"seqlen {seqlen}\n{'table':11} {'hd':>4} {'tile':>14} {'options':>14} | {'TFLOP/s':>8} {'causal':>8}")
    for (name, hd), candidates in CANDIDATES.items():
        tensors = inputs(seqlen, hd)
        original = table[name][hd]
        for tile in candidates:
            table[name][hd] = tile
            _plan._plans.clear()  # cached launch plans hold the previous tile
            for options in option_sets(name, tensors[0].shape[2]):
                row = [tflops(_config.kernel_pass(name), tensors, causal, **options) for causal in (False, True)]
                label = ",".join(options) or "-"
                print(f"{name:11} {hd:4d} {str(tile):>14} {label:>14} | {row[0]:8.1f} {row[1]:8.1f}", flush=True)
        table[name][hd] = original


if __name__ == "__main__":
    import sys
    for seqlen in [int(a) for a in sys.argv[1:]] or [4096]:
        main(seqlen)
