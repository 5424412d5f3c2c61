"""bench/context_parallel.py's plumbing on the CPU: two gloo processes time the ring and the
single-device baseline on a tiny sequence and write the table (PyTorch's own context parallel gives
a blank cell with its reason where it does not run)."""

import os
import re
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import context_parallel  # noqa: E402


def test_the_weak_scaling_table_is_written(tmp_path):
    torch.multiprocessing.spawn(context_parallel.run, nprocs=2,
                                args=(2, f"file://{tmp_path / 'rendezvous'}", [64], 1, "cpu", str(tmp_path)))
    text = (tmp_path / "context_parallel.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 64 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "32" and all(float(c) > 0 for c in cells[2:6]), row
    assert re.match(r"[\d.]+$|\w+Error", cells[6]), row
