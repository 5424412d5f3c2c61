"""Times decode steps at each split count (bench/notes/v41): for each cell, the count that
`_kvcache.splits` picks and the fixed counts of COUNTS, each step replayed from a CUDA graph of 20
(no host time between steps, as a serving loop runs them), median of 15 replays, us per step.
Prints a JSON line per cell: the picked count, its time, the best count and every count's time.

Usage (GPU): PYTHONPATH=. python bench/decode_splits.py [--counts N ...] [--cells B:CACHE:H:HK:HD:LAYOUT ...]
(bf16, the cache full, one query row with --cells; timed as bench/ab.py times decode cells; the
cells as ab.py's --cells spell them, default CELLS; the counts default COUNTS)
"""
import argparse
import json

COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
CELLS = [  # batch, cache, nheads, nheads_k, headdim, seqlen_q, page size (0: dense)
    (4, 4096, 8, 1, 128, 1, 0), (128, 1024, 8, 1, 64, 1, 0), (1, 4096, 8, 1, 128, 1, 0), (1, 4096, 32, 8, 64, 1, 0),
    (128, 1024, 8, 1, 128, 1, 0), (1, 16384, 8, 1, 128, 1, 0), (16, 1024, 8, 1, 128, 1, 0), (1, 1024, 32, 32, 128, 1, 0),
    (16, 1024, 32, 8, 64, 1, 0), (64, 1024, 8, 1, 64, 1, 0), (4, 1024, 32, 8, 128, 1, 0), (1, 4096, 32, 8, 128, 1, 0),
    (16, 4096, 8, 1, 128, 1, 0), (4, 16384, 8, 1, 64, 1, 0), (1, 1024, 8, 1, 64, 1, 0), (1, 16384, 32, 8, 64, 1, 0),
    (128, 4096, 8, 1, 128, 1, 0), (4, 4096, 32, 32, 128, 1, 0), (16, 4096, 32, 8, 128, 1, 0), (1, 65536, 8, 1, 128, 1, 0),
    (4, 131072, 8, 1, 64, 1, 0), (1, 131072, 32, 8, 128, 1, 0), (16, 16384, 32, 8, 128, 1, 0),
    (128, 1024, 32, 8, 128, 1, 0), (4, 4096, 8, 1, 128, 4, 0), (1, 16384, 32, 8, 128, 4, 0),
    (128, 1024, 8, 1, 64, 1, 16), (4, 4096, 8, 1, 128, 1, 16),
]


def main(argv=None):
    from ab import parse_decode_cell
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=COUNTS, help="the split counts timed")
    parser.add_argument("--cells", type=parse_decode_cell, nargs="+", help="batch:cache:nheads:nheads_k:hd:layout")
    args = parser.parse_args(argv)
    cells = [(b, c, h, hk, hd, 1, page) for b, c, h, hk, hd, page in args.cells] if args.cells else CELLS
    import cupy
    from ab import decode_inputs, graph_step_ms
    from cupyflash import _kvcache, flash_attn_with_kvcache
    picked, rule = [], _kvcache.splits

    def recorded(*args):  # the rule, its count kept for the report
        picked.append(rule(*args))
        return picked[-1]
    _kvcache.splits = recorded
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for batch, cache, nheads, nheads_k, headdim, seqlen_q, page in cells:
            q, k_cache, v_cache, table, lengths = decode_inputs(batch, cache, nheads, nheads_k, headdim, page, seqlen_q)
            stream.synchronize()

            def timed(count):
                return 1000 * graph_step_ms(lambda: flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, num_splits=count), stream)
            picked.clear()
            auto = timed(0)
            times = {count: timed(count) for count in args.counts if count * 16 <= cache}
            best = min(times, key=times.get)
            tbps = 4 * batch * cache * nheads_k * headdim / 1e6  # K and V bytes over us
            print(json.dumps(dict(cell=[batch, cache, nheads, nheads_k, headdim, seqlen_q, page],
                                  picked=picked[-1] if picked else None, picked_us=round(auto, 2), best=best,
                                  best_us=round(times[best], 2), us={c: round(t, 2) for c, t in times.items()},
                                  tbps={c: round(tbps / t, 3) for c, t in times.items()})),
                  flush=True)
            del q, k_cache, v_cache, table


if __name__ == "__main__":
    main()
