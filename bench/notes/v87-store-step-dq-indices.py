"""v87: store_step_dq's chunk mapping (notes/v87-wgmma-stores-dq.patch, cuda_src/sm90/bwd.cuh) checked in
Python against the layouts the consumers write (common/mask.cuh dq_accum_index and
dq_accum_fragment_index): every (row, 8-column chunk) of a step once, its 8 floats where the writer
reads them, and in the 80-row order at most two lanes of a warp's load on one bank."""
def dq_accum_index(row, col, width):
    return (row & ~7) * width + (col & ~7) * 8 + (row & 7) * 8 + (col & 7)
def frag(row, col, rows):
    m = col % 64; thread = 32 * (m // 16) + 4 * (m % 8) + (row % 8) // 2
    return (((col // 64) * (rows // 8) + row // 8) * 128 + thread) * 4 + (m % 16) // 8 * 2 + row % 2
for HD, BM, transposed in [(64, 128, False), (64, 64, False), (128, 64, False), (128, 80, True)]:
    cpr = HD // 8
    seen = set()
    for c in range(BM * cpr):
        if transposed:
            pair = c // 16 % (cpr // 2)
            row = c // 16 // (cpr // 2) * 8 + c % 8
            col = (2 * pair + c // 8 % 2) * 8
            first = frag(row, col, BM)
            for i in range(8):
                assert frag(row, col + i, BM) == first + 16 * i
        else:
            row = c // 8 // cpr * 8 + c % 8
            col = c // 8 % cpr * 8
            for i in range(8):
                assert dq_accum_index(row, col + i, HD) == 8 * c + i
        assert 0 <= row < BM and 0 <= col < HD
        seen.add((row, col))
    assert len(seen) == BM * cpr
    if transposed:  # banks of a warp's load i
        for base in range(0, BM * cpr, 32):
            for i in range(8):
                banks = {}
                for c in range(base, base + 32):
                    pair = c // 16 % (cpr // 2); row = c // 16 // (cpr // 2) * 8 + c % 8; col = (2 * pair + c // 8 % 2) * 8
                    idx = frag(row, col, BM) + 16 * i
                    banks.setdefault(idx % 32, set()).add(idx)
                assert max(len(v) for v in banks.values()) <= 2, banks
    print(HD, BM, transposed, "ok")
