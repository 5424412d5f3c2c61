"""The decode plan's choices for call shapes on a modelled GPU, without one: the table, the kv heads
a tile, the split count and the key rows each split streams (`_kvcache.decode_layout`, the rules
`flash_attn_with_kvcache` plans by). Each decode kernel compiles here with NVRTC for its registers
and static shared memory (the cubin's records), and the GPU is one of MODELS, so a kernel's resident
CTAs are what `_schedule.resident_ctas` works out on that device. Not modelled: whether a call's
splits merge in clusters (it asks the driver how many clusters fit; it does not change the layout).

    python bench/decode_plans.py [--gpu h100] [--split-rows N] batch:cache:nheads:nheads_k:hd:layout ...

A cell is bench/ab.py's decode cell (layout dense or pagedN), one query row, bf16, causal (the
kernels' LOCAL variants, as tests/test_kvcache_gpu.py's calls), the cache full; --split-rows sets `_kvcache.HEADS_SPLIT_ROWS` (the rule's bound) for the run.
"""

import argparse
import pathlib
import sys
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from ab import parse_decode_cell  # noqa: E402
from cupyflash import _compile, _config, _kvcache, _schedule  # noqa: E402

# CUDA's attribute names; the H100 SXM's, which the H200's equal.
MODELS = {
    "h100": dict(compute_capability=(9, 0), MultiProcessorCount=132, MaxRegistersPerMultiprocessor=65536,
                 MaxSharedMemoryPerMultiprocessor=233472, MaxSharedMemoryPerBlockOptin=232448,
                 MaxThreadsPerMultiProcessor=2048, MaxBlocksPerMultiprocessor=32),
}


def static_smem(cubin):
    """The static shared memory of a one-kernel cubin: its .nv.shared.<kernel> section."""
    sections = _compile.elf_sections(cubin)
    return sum(size for name, (_, size) in sections.items()
               if name.startswith(".nv.shared.") and not name.startswith(".nv.shared.reserved"))


def modelled_device(gpu):
    """A _kvcache.DecodeDevice of MODELS[gpu]."""
    attributes = MODELS[gpu]
    cc = attributes["compute_capability"]

    def tile(table, headdim):
        return _config.tile_for(table, headdim, cc, attributes["MaxSharedMemoryPerBlockOptin"])

    def resident(kernel):
        cubin_path, _ = _compile.compile_kernel(kernel, kernel.arch(f"{cc[0]}{cc[1]}"))
        cubin = cubin_path.read_bytes()
        registers, _ = _compile.cubin_resources(cubin)
        return attributes["MultiProcessorCount"] * _schedule.ctas_per_sm(kernel, registers, static_smem(cubin),
                                                                         attributes)
    return _kvcache.DecodeDevice(attributes["MultiProcessorCount"], tile, resident)


def layout_of(cell, device, num_splits=0):
    """decode_layout of a decode cell (ab.py's form) on `device`: one query row, causal."""
    batch, capacity, nheads, nheads_k, headdim, page = parse_decode_cell(cell)
    shape = types.SimpleNamespace(batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=1, headdim=headdim)
    return _kvcache.decode_layout(shape, "bfloat16", True, (), capacity, page, num_splits, device)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cells", nargs="+")
    parser.add_argument("--gpu", choices=sorted(MODELS), default="h100")
    parser.add_argument("--split-rows", type=int, default=None, help="HEADS_SPLIT_ROWS for this run")
    args = parser.parse_args(argv)
    if args.split_rows is not None:
        _kvcache.HEADS_SPLIT_ROWS = args.split_rows
    device = modelled_device(args.gpu)
    layouts = [layout_of(cell, device) for cell in args.cells]
    width = max(len(layout.kernel.name) for layout in layouts) + 2
    print(f"{'cell':28}{'kernel':{width}}{'heads':>6}{'CTAs':>6}{'splits':>7}{'rows a split':>13}")
    for cell, layout in zip(args.cells, layouts):
        rows = -(-parse_decode_cell(cell)[1] * layout.heads // layout.splits)
        print(f"{cell:28}{layout.kernel.name:{width}}{layout.heads:6d}{layout.ctas:6d}{layout.splits:7d}{rows:13d}")


if __name__ == "__main__":
    main(sys.argv[1:])
