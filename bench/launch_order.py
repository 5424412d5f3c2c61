"""A model of the causal grid's tail: how much of the SMs' time a launch order leaves idle.

    python bench/launch_order.py

CTAs start in launch order, each on the first free slot (132 SMs x CTAs per SM), and a CTA takes
one unit per block pair it computes plus one for its prologue and epilogue. Under a causal mask a
CTA's work follows its block index, so the order decides how the grid ends: head-major (blocks
fastest, the grid (blocks, heads, batch)) ends on the last head's heaviest CTA; block-major (heads
fastest, the LOCAL kernels' grid since v13) ends on light ones. Prints the share of slot time
that does work (1.0: no tail) for the benchmark's shapes; the prediction in bench/notes/v13-block-major-grids.md.
"""

import heapq

SMS, TOKENS, HIDDEN = 132, 16384, 2048
# pass, head dim, rows of a CTA's own block, rows of the blocks it walks, CTAs per SM (registers)
KERNELS = [("bwd", 64, 128, 128, 1), ("bwd", 128, 128, 64, 1), ("bwd", 256, 64, 64, 1),
           ("fwd", 64, 128, 64, 2), ("fwd", 128, 128, 32, 2), ("fwd", 256, 64, 64, 2)]


def busy_share(works, slots):
    free = [0.0] * slots
    end = 0.0
    for work in works:
        start = heapq.heappop(free)
        heapq.heappush(free, start + work)
        end = max(end, start + work)
    return sum(works) / (slots * end)


def works(seqlen, hd, block, walked, block_major):
    """Each CTA's units in launch order. Both passes take a head's heaviest block first, and the
    b-th CTA of a head walks (seqlen - b * block) / walked blocks: the forward's b-th query block
    from the last sees the keys up to it, the backward's key block b is seen by the queries from it on."""
    heads, batch, blocks = HIDDEN // hd, TOKENS // seqlen, seqlen // block
    weight = lambda b: (seqlen - b * block) / walked + 1  # noqa: E731
    if block_major:
        return [weight(b) for _ in range(batch) for b in range(blocks) for _ in range(heads)]
    return [weight(b) for _ in range(batch) for _ in range(heads) for b in range(blocks)]


if __name__ == "__main__":
    for pass_, hd, block, walked, per_sm in KERNELS:
        cells = []
        for seqlen in (1024, 4096, 16384):
            head = busy_share(works(seqlen, hd, block, walked, False), SMS * per_sm)
            block_major = busy_share(works(seqlen, hd, block, walked, True), SMS * per_sm)
            cells.append(f"{seqlen // 1024}k {head:.3f} -> {block_major:.3f} ({block_major / head - 1:+.1%})")
        print(f"{pass_} hd{hd:<3} " + " | ".join(cells))
