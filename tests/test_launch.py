"""Launches with attributes (cupyflash/_launch.py): the driver structures' layout, the attributes a
launch names, and the decode kernels' side of them (each waits for the kernel before it ahead of
its first global access; a cluster's CTAs meet before and after they read each other's shared memory)."""

import ctypes

import pytest

from cupyflash import _kernels, _launch


def test_launch_structures_match_the_drivers_layout():
    """CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out on 64-bit Linux."""
    assert ctypes.sizeof(_launch._Config) == 56
    assert [_launch._Config.stream.offset, _launch._Config.attributes.offset,
            _launch._Config.attribute_count.offset] == [32, 40, 48]
    assert ctypes.sizeof(_launch._Attribute) == 72 and _launch._Attribute.value.offset == 8


def test_a_launch_names_its_attributes_in_the_drivers_values():
    both = _launch.ExtendedLaunch(0, (16, 2, 1), 256, 1024, 0, dependent=True, cluster=8)
    assert [(a.id, list(a.value[:4])) for a in both.attributes] == [(6, [1, 0, 0, 0]), (4, [8, 1, 1, 0])]
    assert both.config.attribute_count == 2 and list(both.config.grid) == [16, 2, 1]
    cluster = _launch.ExtendedLaunch(0, (6, 1, 1), 128, 0, 0, cluster=3)
    assert [(a.id, list(a.value[:3])) for a in cluster.attributes] == [(4, [3, 1, 1])]
    assert cluster.config.attribute_count == 1


def test_a_cluster_merge_reads_other_ctas_only_between_two_cluster_barriers():
    source = _kernels.Kernel("decode_combine", "bfloat16").source()
    merge = source[source.index("void merge_splits_in_cluster("):]
    merge = merge[:merge.index("\n}\n")]
    reads = [merge.index("ld_cluster_f32("), merge.index("ld_cluster_f32x4(")]
    assert merge.index("cluster_sync();") < min(reads) and max(reads) < merge.rindex("cluster_sync();")
    assert "barrier.cluster.arrive.release" in source and "mapa.shared::cluster" in source


def test_dependent_launches_only_from_compute_capability_9():
    assert not _launch.available((8, 9))
    assert _launch.available((9, 0)) == (_launch._driver("cuLaunchKernelEx", 4) is not None)


def test_each_kvcache_kernel_waits_for_the_kernel_before_it_ahead_of_its_first_global_access():
    """The KV cache's kernels are dependent launches on sm_90 (_kvcache): each waits for the one
    before it (griddepcontrol) before it reads or writes global memory: the append before the
    lengths and k_new, the decode before the lengths and q, the combine before the decode's
    partials. The append allows the next kernel's launch at its start, the decode after its main
    loop (the cp.async loads' wait that ends it), the combine only by ending."""
    source = _kernels.Kernel("decode_combine", "bfloat16").source()

    def body(name):
        text = source[source.index(f"void {name}("):]
        return text[:text.index("\n}\n")]
    for name, first_reads in (("flash_kvcache_append", ("CacheSequence seq(", "p.k_new")),
                              ("flash_decode", ("CacheSequence seq(", "p.q")),
                              ("flash_decode_combine", ("p.lse_partial", "p.out"))):
        text = body(name)
        assert all(text.index("wait_for_prior_grid();") < text.index(read) for read in first_reads), name
    assert body("flash_kvcache_append").index("allow_dependent_grid();") < body("flash_kvcache_append").index(
        "wait_for_prior_grid();")
    decode = body("flash_decode")
    assert decode.index("cp_async_wait<STAGES - 1>();") < decode.index("allow_dependent_grid();") < decode.index(
        "cp_async_wait<0>();")
    assert "allow_dependent_grid();" not in body("flash_decode_combine")
    assert "griddepcontrol.wait" in source and "griddepcontrol.launch_dependents" in source


@pytest.mark.gpu
def test_a_wave_holds_fewer_clusters_the_larger_they_are():
    """cuOccupancyMaxActiveClusters for the decode kernels, which _kvcache asks before merging a
    step's splits in clusters: at least one, at most the resident CTAs over the cluster size, and
    no more clusters of 8 than half those of 4."""
    import cupy
    from cupyflash import _schedule
    device = cupy.cuda.Device()
    if not _launch.available(_schedule.device_info(device.id)[1]):
        pytest.skip("clusters need compute capability 9.0")
    for table in ("decode_small", "decode_few"):
        kernel = _kernels.Kernel("decode", "bfloat16", _schedule.tile(table, 128, device.id))
        slots = {size: _schedule.cluster_slots(kernel, device.id, size) for size in (2, 4, 8)}
        resident = _schedule.resident_ctas(kernel, device)
        assert all(1 <= n <= resident // size for size, n in slots.items()), (table, slots, resident)
        assert slots[8] <= slots[4] // 2 and slots[4] <= slots[2] // 2, (table, slots)
