"""Where CTAs go: the device's attributes, the tile of a pass, grid order, and the split of the
plain backward's last partial wave. Pure host arithmetic on sizes; the kernels read the results
from FlashParams (block_major, tail_units, tail_parts)."""

import functools

from . import _config, _launch
from ._compile import load
from .validate import MAX_GRID_YZ


@functools.cache
def device_attributes(device_id):
    """The device's attributes (CuPy queries every one of them each time it is asked)."""
    import cupy
    return cupy.cuda.Device(device_id).attributes


@functools.cache
def device_info(device_id):
    """(cupy Device, (major, minor) compute capability, opt-in shared memory per block)."""
    import cupy
    device = cupy.cuda.Device(device_id)
    cc = device.compute_capability
    return device, (int(cc[:-1]), int(cc[-1])), device_attributes(device_id)["MaxSharedMemoryPerBlockOptin"]


def kernel_family(table, device_id, headdim=None):
    return _config.kernel_family_for(table, device_info(device_id)[1], headdim)


def tile(table, headdim, device_id, kernel_family=_config.MMA_SYNC):
    _, cc, smem_limit = device_info(device_id)
    return _config.tile_for(table, headdim, cc, smem_limit, kernel_family=kernel_family)


def block_grid(blocks, heads, batch, local):
    """(grid, block_major) of a forward or backward kernel: (blocks, heads, batch), or for the LOCAL
    kernels (heads, blocks, batch), which starts every head's heavy causal blocks first
    (cuda_src/common/mask.cuh grid_slot), where the grid's y dimension can hold the blocks."""
    block_major = local and blocks <= MAX_GRID_YZ
    return ((heads, blocks, batch) if block_major else (blocks, heads, batch)), block_major


# The share of the L2 a group of block-major tiles' K and V may take (tile_group). At 1k tokens,
# causal, bf16 (v26): 0.75 made hd128 11% faster and hd256 23%; 0.5 made hd128 14% faster and left
# hd256's groups too small to take.
GROUP_L2_SHARE = 0.75
# The share a group taken from the tile counter may take once all pairs' K and V exceed
# GROUP_L2_SHARE, by head dim. At 3/8 the next group's first levels find their K and V still in the
# L2 (v38, causal: hd128 4k DRAM reads 344 -> 202 MB, cuDNN's 201; hd64 4k 415 -> 203 MB, 2% faster;
# hd128 1k at batch 16, -3.4% and +0.4% in two runs); hd256 runs 3-8% faster at 4k with the larger
# groups of 3/4, though they read 22% more.
COUNTER_GROUP_L2_SHARE = {64: 0.375, 128: 0.375, 256: GROUP_L2_SHARE}


def tile_group(pairs, kv_bytes_per_pair, l2_bytes, ctas, counter_share):
    """The persistent LOCAL forward's block-major group (FlashParams.block_major; fwd_tile in
    cuda_src/sm90/fwd.cuh): how many (batch entry, head) pairs walk their blocks level by level
    together. All of them where their K and V fit in GROUP_L2_SHARE of the L2, so that each level
    reads them there, not from DRAM. Else a group smaller than all pairs makes rounds of tiles of
    uneven weight: where the kernel takes its tiles from a counter as it finishes them
    (FlashParams.tile_counter, next_tile) that leaves the CTAs balanced, and groups fit in
    `counter_share` of the L2 (COUNTER_GROUP_L2_SHARE; at least one pair); in static rounds
    (`counter_share` None) only a group of a third of the CTAs or more does (a round spans at most
    three levels), else all pairs walk together (bench/notes/v26)."""
    def fit(share):
        return int(l2_bytes * share // max(kv_bytes_per_pair, 1))
    if fit(GROUP_L2_SHARE) >= pairs:
        return pairs
    if counter_share:
        return max(fit(counter_share), 1)
    return pairs if 3 * fit(GROUP_L2_SHARE) < ctas else fit(GROUP_L2_SHARE)


# A wgmma LOCAL backward of at most this many waves of CTAs takes its heaviest blocks first across
# batch entries (pair_group). On an H100 (v56): 4 x 512 causal +6% at hd128, +12% at hd256, +1% at
# hd64 (4 waves); on 16-wave grids (32 x 512, 16 x 1k hd64) one group lost 4-5%: its CTAs in flight
# read more pairs' rows than one batch entry's heads at a time do.
SHORT_GRID_WAVES = 4


def pair_group(batch, heads, bytes_per_pair, l2_bytes, ctas, sms):
    """The wgmma LOCAL backward's (batch entry, kv head) pairs per group (grid_slot in
    cuda_src/common/mask.cuh): where its `ctas` (one an SM) make at most SHORT_GRID_WAVES waves and
    every pair's rows (`bytes_per_pair`: Q, dO and dQ's float32 sums, which every key block of a pair
    reads or adds to) fit GROUP_L2_SHARE of the L2, all pairs, so that the grid starts every batch
    entry's heaviest causal blocks first and ends on light ones; else the most heads of a batch
    entry, a divisor of `heads`, whose rows fit that share (at least one), so that the CTAs in flight
    mostly share a group's rows."""
    fit = max(int(l2_bytes * GROUP_L2_SHARE // max(bytes_per_pair, 1)), 1)
    if ctas <= SHORT_GRID_WAVES * sms and batch * heads <= fit:
        return batch * heads
    return max(g for g in range(1, min(fit, heads) + 1) if heads % g == 0)


def resident_ctas(kernel, device):
    """How many CTAs of `kernel` the device runs at once: SMs times what one SM holds."""
    function, attributes = load(kernel, device), device_attributes(device.id)
    return attributes["MultiProcessorCount"] * ctas_per_sm(kernel, function.num_regs, function.shared_size_bytes,
                                                           attributes)


def ctas_per_sm(kernel, registers, static_smem, attributes):
    """How many CTAs of `kernel`, of `registers` a thread and `static_smem` bytes of static shared
    memory, one SM of a device with these attributes (CUDA's names) holds, at least one: registers
    are given out 256 a warp, and each CTA takes 1 KiB of shared memory for the system."""
    warps = kernel.threads // 32
    by_registers = attributes["MaxRegistersPerMultiprocessor"] // (warps * -(-registers * 32 // 256) * 256)
    by_smem = attributes["MaxSharedMemoryPerMultiprocessor"] // (kernel.smem_bytes + static_smem + 1024)
    return max(min(by_registers, by_smem, attributes["MaxThreadsPerMultiProcessor"] // kernel.threads,
                   attributes["MaxBlocksPerMultiprocessor"]), 1)


@functools.cache
def cluster_slots(kernel, device_id, cluster):
    """How many clusters of `cluster` CTAs of `kernel` the device runs at once (one wave of them)."""
    function = load(kernel, device_info(device_id)[0]).kernel.ptr
    return _launch.max_active_clusters(function, kernel.threads, kernel.smem_bytes, cluster)


def tail_split(units, steps, resident):
    """(tail_units, tail_parts) for a plain backward of `units` CTAs of `steps` query steps each,
    `resident` of them running at once: the last units % resident CTAs would run while the other
    slots idle, so each may be split into `tail_parts` pieces (TailSplit, cuda_src/sm80/bwd_schedule.cuh)
    that run as one or more waves of shorter CTAs. Costs in steps: a CTA's own loads and stores
    count as one step more, a piece's adds and sums as two. A split must save a fifth of the last wave."""
    tail = units % resident
    if tail == 0:
        return 0, 1
    best_cost, best_parts = steps + 1, 1
    for parts in range(2, min(steps, resident) + 1):
        cost = -(-tail * parts // resident) * (-(-steps // parts) + 2)
        if cost < best_cost:
            best_cost, best_parts = cost, parts
    return (tail, best_parts) if best_cost <= 0.8 * (steps + 1) else (0, 1)
