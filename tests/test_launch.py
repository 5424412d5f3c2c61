"""Dependent launches (cupyflash/_launch.py): the driver structures' layout, and the decode kernels'
side of them (the combine waits for the decode before its first read)."""

import ctypes

from cupyflash import _kernels, _launch


def test_launch_structures_match_the_drivers_layout():
    """CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out on 64-bit Linux."""
    assert ctypes.sizeof(_launch._Config) == 56
    assert [_launch._Config.stream.offset, _launch._Config.attributes.offset,
            _launch._Config.attribute_count.offset] == [32, 40, 48]
    assert ctypes.sizeof(_launch._Attribute) == 72 and _launch._Attribute.value.offset == 8


def test_dependent_launches_only_from_compute_capability_9():
    assert not _launch.available((8, 9))
    assert _launch.available((9, 0)) == (_launch._launch_kernel_ex() is not None)


def test_the_combine_waits_for_the_decode_before_reading_its_partials():
    """flash_decode_combine's first global read comes after the wait; flash_decode allows the
    combine's launch at its start (it reads nothing the combine writes)."""
    source = _kernels.Kernel("decode_combine", "bfloat16").source()
    body = source[source.index("void flash_decode_combine("):]
    body = body[:body.index("\n}\n")]
    assert body.index("wait_for_prior_grid();") < body.index("p.lse_partial")
    decode = source[source.index("void flash_decode("):source.index("void flash_decode_combine(")]
    assert decode.index("allow_dependent_grid();") < decode.index("p.q")
    assert "griddepcontrol.wait" in source and "griddepcontrol.launch_dependents" in source
