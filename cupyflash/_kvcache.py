"""flash_attn_with_kvcache on the GPU: the KV-cache kernels of cuda_src/sm80/decode.cuh.

A call is up to three launches on the caller's stream, planned once per call signature
(_plan.Plan): the new keys (rotated) and values appended into the caches (kvcache_append, when k
and v are given); attention of the packed query rows of each KV group over its sequence's cache,
the keys split into num_splits ranges (decode); and the splits merged by log-sum-exp
(decode_combine, with more than one; on sm_90, where one wave holds them, up to _launch.MAX_CLUSTER
splits of a query block are one thread-block cluster that merges them itself, with no third
launch). On sm_90 all three are dependent launches, each placed while the kernel before it
drains. The split count follows from shapes alone, and nothing is read on the host but what
validation reads (validate.reads_device_values), so a decode step captures in a CUDA graph and
replays as the lengths change on the device.
"""

import math
from typing import Callable, NamedTuple

from . import _arrays, _config, _kernels, _launch, _plan, _schedule

MAX_SPLITS = 128
STREAMING_WARPS = 8  # warps per SM that keep a short cache's reads at the copy bandwidth (streaming_slots)
PAGED_CTAS_PER_SM = 2  # resident CTAs per SM that read a long paged cache fastest (streaming_slots)
# The plan's inputs by FlashParams field, in flash_attn_with_kvcache's order of array arguments: the
# caches are `k` and `v`, the new keys and values `k_new` and `v_new`.
FIELDS = ("q", "k", "v", "k_new", "v_new", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
          "cache_leftpad", "block_table", "alibi_slopes")


def signature(arrays, scalars):
    """The key of a call's plan in _plan's cache: the layout of each array argument
    (flash_attn_with_kvcache's, in FIELDS' order, None where not given) and the type and value of
    each scalar argument (an int cache_seqlens among them); None where something cannot be part of
    a key (NumPy arrays, lists)."""
    key = ["kvcache", _config.forced_choices()]
    for value in scalars:
        try:
            hash(value)
        except TypeError:
            return None
        key += (type(value), value)
    for array in arrays:
        if array is None or not hasattr(array, "shape"):
            key.append(None)
            continue
        cls = type(array)
        kind = _arrays.kind_of_type(cls)
        if kind == "torch":
            key.append((cls, array.shape, array.stride(), array.dtype, array.get_device()))
        elif kind == "cupy":
            key.append((cls, array.shape, array.strides, array.dtype, array.data.device_id))
        else:
            return None
    return tuple(key)


def _by_field(arrays):
    return {name: array for name, array in zip(FIELDS, arrays) if array is not None and hasattr(array, "shape")}


def run_resolved(key, arrays, return_softmax_lse):
    """The call's result through the plan of its signature, or None where there is none yet (or an
    input is not aligned as the plan's were)."""
    plan = _plan.cached(key)
    if plan is None:
        return None
    results = plan.run(_by_field(arrays), None, dropped=() if return_softmax_lse else ("lse",))
    if results is None:
        return None
    return results if return_softmax_lse else results[0]


def attention(call, cache, arrays, return_softmax_lse, key):
    """(out, lse) of a checked GPU call (validate.check_kvcache) with these array arguments (in
    FIELDS' order), in the caller's kind of array; the caches are written in place. The plan is
    kept under `key` (signature())."""
    result = run_resolved(key, arrays, return_softmax_lse)
    if result is not None:
        return result
    arrays = [call.caller.launchable(a) if hasattr(a, "shape") else a for a in arrays]
    inputs, copied = _launchable(call.caller, _by_field(arrays))
    plan = _new_plan(call, cache, inputs)
    if not copied:
        _plan.store(key, plan)
    out, lse = plan.run(inputs, None, dropped=() if return_softmax_lse else ("lse",))
    return (out, lse) if return_softmax_lse else out


def _launchable(caller, arrays):
    """(the call's arrays as the kernels read them, whether any was copied): _plan._launchable's, but
    the caches, written in place, cannot be copied: their rows must be 16-byte aligned (cp.async)."""
    for name, cache in (("k", "k_cache"), ("v", "v_cache")):
        strides = _arrays.element_strides(arrays[name])
        if caller.data_pointer(arrays[name]) % 16 or any(s * 2 % 16 for s in strides[:-1]):
            raise ValueError(f"{cache} must start on a 16-byte boundary with every stride but the last a multiple "
                             f"of 8 elements (the kernels read 16-byte rows, and the cache is written in place); "
                             f"got strides {strides}")
    return _plan._launchable(caller, arrays)


def streaming_slots(warps, sms, resident, capacity, paged):
    """How many decode CTAs of `warps` warps read a cache of `capacity` rows per sequence at the
    copy bandwidth together, on a GPU of `sms` SMs that holds `resident` of them at once. Short
    streams (dense caches of at most SHORT_CACHE rows, paged ones of a quarter of that): about
    STREAMING_WARPS warps per SM (one CTA of the 6- and 8-warp tiles, two of the 4-warp one:
    bench/notes/v41's sweep), since a longer wave adds its fixed costs to streams of a few key
    blocks. Longer dense ones: every resident CTA (v42's grid: 128 CTAs of long or 4k paged caches,
    one per SM, read at 0.6-0.85x the speed of two per SM). Longer paged ones, whose table reads add
    latency to each: up to PAGED_CTAS_PER_SM per SM (bench/notes/v67, H100: hd64's 4-warp tile, five
    resident per SM, read 16-row pages of 16k-128k rows split for two per SM +1.8-5.3% in 9 of 13
    cells, -1.2 to -2.6% in three, where dense caches of those lengths read 1-4% slower so)."""
    if capacity <= (_config.SHORT_CACHE // 4 if paged else _config.SHORT_CACHE):
        return min(resident, _short_stream_slots(warps, sms))
    return min(resident, PAGED_CTAS_PER_SM * sms) if paged else resident


def _short_stream_slots(warps, sms):
    """About STREAMING_WARPS warps per SM, in CTAs of `warps` warps (streaming_slots)."""
    return sms * max(1, round(STREAMING_WARPS / warps))


def splits(ctas, key_blocks, warps, slots, sms):
    """How many key ranges each of `ctas` CTAs' keys are split into, `slots` CTAs streaming at once
    (streaming_slots) on `sms` SMs: as many as fit the slots in one wave (a CTA past them doubles
    its SM's stream: v42's grid), none where the CTAs fill 80% of them (each split adds its
    partials to the combine's reads and shortens each CTA's stream past its fixed costs). Where
    the slots are one CTA per SM (one streams at about its SM's share of the bandwidth, however few
    run: v42's 144 CTAs on 132 SMs took twice one wave's time) and that count leaves long streams'
    waves partly idle (104 CTAs on 132 SMs; 140, whose last 8 stream a whole cache each after the
    others are done), the count of least modelled time (_waves_time) if it saves a tenth. A split
    keeps whole key blocks for each warp, and the count is that of the splits that get keys, so
    that none is launched empty."""
    most = min(MAX_SPLITS, -(-key_blocks // warps))  # at least a key block per warp
    count, per_split = _splits_with_keys(key_blocks, warps, 1 if ctas >= 0.8 * slots else min(most, slots // ctas))
    waves = ctas * count / slots
    if slots <= sms and waves / math.ceil(waves) < UNEVEN_WAVES and per_split // warps >= LONG_STEPS:
        times = {c: _waves_time(ctas, key_blocks, warps, slots, c) for c in range(1, most + 1)}
        best = min(times, key=times.get)
        if times[best] <= 0.9 * times[count]:
            count = _splits_with_keys(key_blocks, warps, best)[0]
    return count


# splits() models the count where the waves fill less than UNEVEN_WAVES of their slots with splits of
# at least LONG_STEPS steps (a key block per warp): powers of two of CTAs fill 97% of 132 SMs, so
# the measured grid keeps its counts, and short caches keep the counts their sweeps chose (v41).
UNEVEN_WAVES, LONG_STEPS = 0.85, 64
# A decode CTA's fixed cost (its first loads' latency, the warps' merge, its partials) and the
# combine's, in steps: about what v41's sweep read (128 x 1k hd128 8/1: one split of 11 steps
# 20.9 us, two of 6 steps on two waves 28.3).
CTA_STEPS, COMBINE_STEPS = 4, 4


def _splits_with_keys(key_blocks, warps, count):
    """(how many of `count` splits get keys, key blocks a split): flash_decode gives each split
    ceil(key_blocks / count) blocks rounded up to a multiple of `warps`."""
    per_split = -(-(-(-key_blocks // count)) // warps) * warps
    return -(-key_blocks // per_split), per_split


def _waves_time(ctas, key_blocks, warps, slots, count):
    """The modelled time, in steps, of a decode of `ctas` CTAs split `count` ways: its waves of
    `slots`, each a split's steps and a CTA's fixed cost long, and the combine."""
    count, per_split = _splits_with_keys(key_blocks, warps, count)
    return -(-ctas * count // slots) * (per_split // warps + CTA_STEPS) + (COMBINE_STEPS if count > 1 else 0)


def _table(ctas, page_rows, capacity, headdim, device):
    """The decode tile table of a call of `ctas` CTAs (one split each) streaming `capacity` key rows
    each, in pages of `page_rows` (0: dense), on `device` (a DecodeDevice): _config.decode_table's, but
    where the few-CTA tile would run at most half the warps the small pages' tile runs after each
    is split (a tiny call, whose splits stop at a key block per warp): there more, shorter streams
    finish sooner (bench/notes/v43: hd64 1 x 1k 8/1 6.3 us a step on the small tile, 7.5 on the
    few-CTA one; 16 x 1k 8/1 7.5 against 8.0)."""
    sms = device.sms
    table = _config.decode_table(page_rows, capacity, ctas, sms)
    if table != "decode_few" or capacity > _config.SHORT_CACHE:
        return table

    def warps(name):  # launched after splitting, in a short cache's slots, residency aside
        tile = device.tile(name, headdim)
        slots = _short_stream_slots(tile.warps, sms)
        return ctas * splits(ctas, -(-capacity // tile.block_n), tile.warps, slots, sms) * tile.warps
    return "decode_small" if warps("decode_small") >= 2 * warps(table) else table


# Splits of at most this many steps (a key block per warp) are short enough that the combine's
# launch and round trip weigh more than doubling them (fewer_splits_in_clusters): the second
# block's loads are in flight with the first's (v58, H100: dense 1k cells of 1-2 steps a split
# +2-15%; 16 x 4k hd128's 8 splits of 4 steps 9% slower as fewer, longer ones in clusters).
SHORT_SPLIT_STEPS = 2


def fewer_splits_in_clusters(count, key_blocks, warps, clusters_fit):
    """`count` splits of a short step (at most SHORT_SPLIT_STEPS steps each) whose clusters would
    not fit one wave, so that the combine merges them: the most splits, at least half of `count`,
    whose clusters do fit (`clusters_fit(splits)`), as each split that gets keys counts them; a
    cluster merges its splits with no combine launch (v46: +5-17% on 1k cells). Else `count`."""
    count, per_split = _splits_with_keys(key_blocks, warps, count)
    if count <= 1 or clusters_fit(count) or per_split // warps > SHORT_SPLIT_STEPS:
        return count
    for fewer in range(min(count, _launch.MAX_CLUSTER), -(-count // 2) - 1, -1):
        fewer = _splits_with_keys(key_blocks, warps, fewer)[0]
        if 2 * fewer >= count and clusters_fit(fewer):
            return fewer
    return count


# Several kv heads a tile leave fewer CTAs, each split more ways: a split of fewer key rows (its
# heads' rows of its tokens) than this runs faster as one head's (bench/notes/v69, H100, 256-row
# pages: four heads' splits of 1024-4096 rows lost 1-12% (1-4 x 16k, 1 x 64k); of 7943-32768
# rows they read -2.4 to +5% (1-4 x 128k)).
HEADS_SPLIT_ROWS = 6144


def decode_heads(table, nheads_k, rows_per_head, block_rows, copy_rows, capacity):
    """How many kv heads a decode tile takes together (sm80/decode.cuh PackedRows, the kv_heads
    kernels). Where one head a tile would run `table` 'decode' (long caches of more CTAs than SMs,
    or in pages of DENSE_TILE_PAGE rows or more), the most: a power of two dividing nheads_k, at
    most `copy_rows` (Tile.decode_copy_rows: each copy step then starts a token), whose
    `rows_per_head` packed query rows each fit one tile of `block_rows`. Their rows of a token are
    adjacent in the cache, so the tile reads them as one run, where one head's 128-byte rows a CTA
    stream 2-5% slower (bench/notes/v68: hd64 64 x 128k +1.5-5.1%, 128 x 8k +2.1-4.9%, 256-row pages
    +1.2-4.3%). Other calls keep one head: they need their CTAs (v68: short caches and small pages
    lost 3-28% with several, dense calls of at most a CTA an SM 0.7-2%). The virtual rows, `capacity`
    a head times the heads, stay at most 2^30 (the kernel's int positions, with room for a block).
    The plan then halves them while its splits are short (HEADS_SPLIT_ROWS)."""
    heads = 1
    while (table == "decode" and 2 * heads <= copy_rows and nheads_k % (2 * heads) == 0
           and 2 * heads * rows_per_head <= block_rows and 2 * heads * capacity <= 2 ** 30):
        heads *= 2
    return heads


class DecodeDevice(NamedTuple):
    """What the decode rules read of a GPU: its SMs, its tile of a decode table for a head dim
    (table, headdim -> _config.Tile), and how many CTAs of a kernel it runs at once (kernel -> int).
    _new_plan's are the device's; bench/decode_plans.py models one without a GPU."""
    sms: int
    tile: Callable
    resident: Callable


class DecodeLayout(NamedTuple):
    """A decode call's grid: `heads` kv heads a tile, query blocks of a kv head's packed rows, CTAs
    (one split each), tile and kernel, key blocks of a CTA's stream, and the split count."""
    heads: int
    m_blocks: int
    ctas: int
    tile: _config.Tile
    kernel: _kernels.Kernel
    key_blocks: int
    splits: int


def decode_layout(shape, dtype, local, features, capacity, page_size, num_splits, device):
    """The DecodeLayout of a call of `shape` (validate's: batch, nheads, nheads_k, seqlen_q,
    headdim) over a cache of `capacity` rows in pages of `page_size` (0: dense), `num_splits` given
    (0: chosen) on `device` (a DecodeDevice): the kv heads a tile (decode_heads), halved while a split
    would stream fewer than HEADS_SPLIT_ROWS rows, and each one's split count."""
    rows_per_head = shape.seqlen_q * shape.nheads // shape.nheads_k  # a kv head's packed (query, head) rows
    decode_tile = device.tile("decode", shape.headdim)  # (block_m and head dim: every decode table's)
    block_rows = decode_tile.block_m
    one_head_ctas = -(-rows_per_head // block_rows) * shape.nheads_k * shape.batch
    one_head_table = _table(one_head_ctas, page_size, capacity, shape.headdim, device)

    def layout(heads):
        m_blocks = -(-rows_per_head * heads // block_rows)
        ctas = m_blocks * (shape.nheads_k // heads) * shape.batch
        # The rules see the key rows a CTA streams: a token's row of each of its kv heads.
        rows, page_rows = capacity * heads, page_size * heads
        table = one_head_table if heads == 1 else _table(ctas, page_rows, rows, shape.headdim, device)
        tile = device.tile(table, shape.headdim)
        kernel = _kernels.Kernel("decode", dtype, tile, local, False, features, kv_heads=heads > 1)
        key_blocks = -(-rows // tile.block_n)
        count = num_splits
        if not count:
            slots = streaming_slots(tile.warps, device.sms, device.resident(kernel), rows, page_size > 0)
            count = splits(ctas, key_blocks, tile.warps, slots, device.sms)
        return DecodeLayout(heads, m_blocks, ctas, tile, kernel, key_blocks, max(1, min(count, MAX_SPLITS, key_blocks)))

    chosen = layout(decode_heads(one_head_table, shape.nheads_k, rows_per_head, block_rows,
                                 decode_tile.decode_copy_rows, capacity))
    while chosen.heads > 1 and capacity * chosen.heads < HEADS_SPLIT_ROWS * chosen.splits and not num_splits:
        chosen = layout(chosen.heads // 2)
    return chosen


def _new_plan(call, cache, arrays):
    shape, caller = call.shape, call.caller
    device_id = caller.device_id
    device = DecodeDevice(_schedule.device_attributes(device_id)["MultiProcessorCount"],
                          lambda table, headdim: _schedule.tile(table, headdim, device_id),
                          lambda kernel: _schedule.resident_ctas(kernel, caller.device()))
    heads, m_blocks, ctas, tile, kernel, key_blocks, count = decode_layout(
        shape, call.dtype, call.local, call.features, cache.capacity, cache.page_size, cache.num_splits, device)

    # One cluster per query block's splits, unless the clusters would take a second wave: a GPC
    # holds a whole number of them, so fewer fit than SMs over the cluster size (bench/notes/v46:
    # 16 clusters of 8 where 15 fit ran at 0.63x the combine's speed; 8 of 8 and 64 of 2 gained 13-17%).
    def clusters_fit(splits_):
        return (1 < splits_ <= _launch.MAX_CLUSTER and _launch.available(_schedule.device_info(device_id)[1])
                and ctas <= _schedule.cluster_slots(kernel, device_id, splits_))
    if not cache.num_splits and not cache.page_size:  # (paged 1k caches: 3-6% slower with fewer, v58)
        count = fewer_splits_in_clusters(count, key_blocks, tile.warps, clusters_fit)
    merge_in_cluster = clusters_fit(count)
    params = params_of(call, cache, arrays, tile, count)
    params["merge_in_cluster"], params["decode_heads_log2"] = int(merge_in_cluster), heads.bit_length() - 1
    q = arrays["q"]
    stats = (shape.batch, shape.nheads, shape.seqlen_q)
    outputs = [_plan._Output("out", tuple(q.shape), call.dtype), _plan._Output("lse", stats, "float32")]
    launches = []
    if cache.seqlen_new:
        append = _kernels.Kernel("kvcache_append", call.dtype)
        launches.append(_plan._Launch(append, (cache.seqlen_new, shape.batch, 1), dependent=True))
    launches.append(_plan._Launch(kernel, (m_blocks * count, shape.nheads_k // heads, shape.batch), dependent=True,
                                  cluster=count if merge_in_cluster else 1))
    if count > 1 and not merge_in_cluster:
        rows = math.prod(stats)
        outputs += [_plan._Output("out_partial", (count, rows, shape.headdim), "float32", scratch=True),
                    _plan._Output("lse_partial", (count, rows), "float32", scratch=True)]
        launches.append(_plan._Launch(_kernels.Kernel("decode_combine", call.dtype), (rows, 1, 1), dependent=True))
    return _plan.Plan(caller, params, arrays, outputs, launches)  # (out, lse)


def params_of(call, cache, arrays, tile, count):
    """The decode plan's parameter block: the fields of every plan (_plan._param_block: sizes, scale,
    strides, the options'), then the cache's; `arrays` by FlashParams field, `count` splits."""
    strides = {name: _arrays.element_strides(arrays[name]) for name in ("q", "k", "v", "k_new", "v_new")
               if name in arrays}
    strides["out"] = _plan._contiguous_strides(tuple(arrays["q"].shape))
    params = _plan._param_block(call, tile, {name: _plan._tensor_strides(s, False) for name, s in strides.items()},
                                arrays, block_major=False)
    fields = dict(seqlen_new=cache.seqlen_new, capacity=cache.capacity, cache_rows=int(cache.k_cache.shape[0]),
                  cache_seqlens_all=_full_length(cache), page_size=cache.page_size,
                  num_splits=count, rotary_interleaved=int(cache.rotary_interleaved), rotary_q_per_row=int(call.local))
    if "block_table" in arrays:
        fields["block_table_batch_stride"] = _arrays.element_strides(arrays["block_table"])[0]
    if "rotary_cos" in arrays:
        cos, sin = arrays["rotary_cos"], arrays["rotary_sin"]
        fields.update(rotary_rows=int(cos.shape[0]), rotary_dim=2 * int(cos.shape[1]),
                      rotary_is_float32=int(_arrays.dtype_name(cos) == "float32"),
                      rotary_cos_row_stride=_arrays.element_strides(cos)[0],
                      rotary_sin_row_stride=_arrays.element_strides(sin)[0])
    for name, value in fields.items():
        params[name] = value
    return params


def _full_length(cache):
    """Every sequence's cached length when cache_seqlens is an int or None (the cache is full)."""
    if cache.seqlens_int is not None:
        return cache.seqlens_int
    return cache.capacity - cache.seqlen_new
