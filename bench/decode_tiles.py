"""Times decode tiles x split counts (bench/notes/v30): for each cell, cuDNN's figure, then each
candidate tile forced on both decode tables, on the dense cache and on random 16-row pages, at the
split count `_kvcache.splits` picks (marked *) and at half, twice and four times it. TB/s of K and V
read (bf16, seqlen_q 1), each step replayed from a CUDA graph (benchmark.GraphTimer), median of 5.

Usage (GPU): python bench/decode_tiles.py [--tiles=N:W:S,...] [B:CACHE:H:HK:HD ...]   (default: TILES,
CELLS; compile first with --compile: NVRTC, no GPU needed)
"""
import sys
from cupyflash import _config, _kernels, _compile, _plan, _kvcache, _schedule

TILES = {128: [(16, 4, 2), (16, 6, 2), (16, 8, 2), (16, 8, 3), (16, 4, 3), (16, 6, 3), (32, 4, 2), (32, 6, 2)],
         64: [(32, 4, 2), (16, 4, 2), (16, 6, 2), (16, 8, 2), (16, 8, 3), (32, 6, 2), (32, 8, 2), (32, 8, 3), (32, 4, 3)]}
CELLS = [(1, 131072, 32, 8, 128), (1, 131072, 32, 8, 64), (1, 131072, 8, 1, 128), (16, 16384, 32, 8, 128),
         (128, 1024, 32, 8, 128), (128, 1024, 32, 8, 64), (16, 1024, 32, 8, 128), (8, 131072, 32, 8, 128),
         (16, 131072, 8, 1, 64), (1, 16384, 32, 32, 128), (16, 1024, 32, 32, 64),
         # few CTAs of half-empty 16-row tiles (MQA, v41's grid: 0.59-0.73 of cuDNN)
         (128, 1024, 8, 1, 64), (128, 1024, 8, 1, 128), (4, 4096, 8, 1, 128), (16, 1024, 8, 1, 128)]


def force(hd, tile):
    n, w, s = tile
    for fam in ("sm90", "sm80"):
        for t in [t for t in _config.TABLES if _config.kernel_pass(t) == "decode"]:
            _config.TILES[_config.MMA_SYNC][fam][t][hd] = (16, n, w, s)
    _plan._plans.clear()


if __name__ == "__main__":
    if sys.argv[1:] == ["--compile"]:
        jobs = [("90", _kernels.Kernel("decode", "bfloat16", _config.Tile(hd, 16, n, w, s), False, False, ()))
                for hd, ts in TILES.items() for n, w, s in ts]
        for a, k, r in _compile.compile_all(jobs, workers=2):
            print(k.name, r.registers, r.spills, flush=True)
        sys.exit()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from cupyflash.torch import flash_attn_with_kvcache
    from cupyflash.benchmark import GraphTimer, median_ms
    from cupyflash.validate import no_host_sync
    dev = torch.device("cuda")
    _kvcache.MAX_SPLITS = 1024  # counts past the table's cap, to see whether the cap costs
    def timed(step):  # ms per step, replayed from a CUDA graph as `bench --decode` times
        return median_ms({0: GraphTimer(step)})[0]
    arguments = sys.argv[1:]
    for argument in [a for a in arguments if a.startswith("--tiles=")]:  # N:W:S,... for every head dim
        arguments.remove(argument)
        chosen = [tuple(map(int, t.split(":"))) for t in argument.removeprefix("--tiles=").split(",")]
        TILES = {hd: chosen for hd in TILES}
    cells = [tuple(map(int, cell.split(":"))) for cell in arguments] or CELLS
    for batch, cache, h, hk, hd in cells:
        g = torch.Generator(device=dev).manual_seed(batch + cache + hd)
        q = torch.randn(batch, 1, h, hd, device=dev, dtype=torch.bfloat16, generator=g)
        kc, vc = (torch.randn(batch, cache, hk, hd, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        tb = lambda ms: 2 * batch * cache * hk * hd * 2 / (ms * 1e-3) / 1e12
        kt, vt, qt = kc.transpose(1, 2), vc.transpose(1, 2), q.transpose(1, 2)
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        kt, vt = kt.contiguous(), vt.contiguous()
        peer = tb(timed(cudnn))
        seqlens = torch.full((batch,), cache, dtype=torch.int32, device=dev)
        pages = cache // 16
        table = torch.randperm(batch * pages, generator=g, device=dev).view(batch, pages).int()
        kp, vp = (torch.empty(batch * pages, 16, hk, hd, device=dev, dtype=torch.bfloat16) for _ in range(2))
        kp[table.flatten().long()] = kc.reshape(batch * pages, 16, hk, hd)
        vp[table.flatten().long()] = vc.reshape(batch * pages, 16, hk, hd)
        del kt, vt
        print(f"cell b{batch} c{cache} h{h}/{hk} d{hd}: cudnn {peer:.2f}", flush=True)
        for tile in TILES[hd]:
            force(hd, tile)
            n, w, s = tile
            kernel = _kernels.Kernel("decode", "bfloat16", _config.Tile(hd, 16, n, w, s), False, False, ())
            try:
                resident = _schedule.resident_ctas(kernel, _schedule.device_info(0)[0])
            except Exception as e:
                print(f"  n{n} w{w} s{s}: {type(e).__name__}", flush=True)
                continue
            m_blocks = -(-h // hk // 16)
            ctas = m_blocks * hk * batch
            sms = _schedule.device_attributes(0)["MultiProcessorCount"]
            line = []
            for layout, (kk, vv, tab) in (("dense", (kc, vc, None)), ("paged", (kp, vp, table))):
                slots = _kvcache.streaming_slots(w, sms, resident, cache, tab is not None)
                default = _kvcache.splits(ctas, -(-cache // n), w, slots, sms)
                for splits in sorted({default, max(1, default // 2), min(1024, default * 2), min(1024, default * 4)}):
                    def step():
                        with no_host_sync():
                            return flash_attn_with_kvcache(q, kk, vv, cache_seqlens=seqlens, block_table=tab,
                                                           num_splits=splits)
                    r = tb(timed(step))
                    line.append(f"{layout}/{splits}{'*' if splits == default else ''} {r:.2f}")
            print(f"  n{n} w{w} s{s} res{resident}: " + " ".join(line), flush=True)
        del kc, vc, kp, vp, q
        torch.cuda.empty_cache()
