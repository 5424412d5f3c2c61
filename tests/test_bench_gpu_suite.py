"""bench/gpu_suite.py's cutting of the GPU suite into parts (no GPU: made-up test ids)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import gpu_suite  # noqa: E402


def test_parts_cover_every_test_once_in_order_and_cut_at_files_nearby():
    ids = ([f"tests/a.py::t[{i}]" for i in range(10)] + [f"tests/b.py::t[x y {i}]" for i in range(3)]
           + [f"tests/c.py::t{i}" for i in range(20)])
    for count in (1, 2, 3, 5):
        cut = gpu_suite.parts(ids, count)
        assert len(cut) == count and sum(cut, []) == ids and all(cut)
    three = gpu_suite.parts(ids, 3)
    assert three[1][0] == "tests/b.py::t[x y 0]"  # the cut at 11 moves back to a.py's end at 10
    assert [len(p) for p in three] == [10, 12, 11]  # c.py has no boundary near 22: cut there
