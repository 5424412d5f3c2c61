"""`bench --decode` without a GPU: the grid and its memory bound, the table it writes from made-up
figures, each implementation's call and the cross-check on CPU tensors (cupyflash.torch runs the
NumPy reference there), and the one-line refusal without a GPU."""

import csv
import math

import pytest

from cupyflash import _arrays, benchmark
from test_bench_host import run


def test_the_grid_keeps_the_cells_that_fit():
    shapes = benchmark.decode_shapes()
    grid = benchmark.DECODE_GRID
    assert all(s.kv_bytes <= benchmark.DECODE_MAX_BYTES for s in shapes)
    assert {s.batch for s in shapes} == set(grid["batches"]) and {s.cache for s in shapes} == set(grid["caches"])
    assert {s.layout for s in shapes} == set(grid["layouts"]) and {s.seqlen_q for s in shapes} == set(grid["seqlens_q"])
    left_out = [s for s in (benchmark.DecodeShape(b, c, h, hk, d, 1, "dense") for b in grid["batches"]
                            for c in grid["caches"] for h, hk in grid["heads"] for d in grid["headdims"])
                if s not in shapes]
    assert left_out and all(s.kv_bytes > benchmark.DECODE_MAX_BYTES for s in left_out)
    assert benchmark.DecodeShape(2, 64, 4, 2, 32, 1, "paged16").page == 16


def test_each_implementation_runs_and_is_checked_against_cupyflash_on_cpu(monkeypatch):
    pytest.importorskip("torch")
    shapes = [benchmark.DecodeShape(2, 64, 4, 2, 32, 1, "dense"), benchmark.DecodeShape(3, 96, 8, 1, 16, 4, "paged16")]
    messages = []
    cells = benchmark.run_decode(shapes, impls=("cupyflash", "SDPA flash (FA2)"), device="cpu", report=messages.append)
    assert [(c.shape, c.impl) for c in cells] == [(s, i) for s in shapes for i in ("cupyflash", "SDPA flash (FA2)")]
    assert all(not c.note for c in cells), [c.note for c in cells]  # both run and agree
    assert len(messages) == len(cells)

    def wrong(shape, q, k, v, generator):
        return lambda: q * 0 + 1
    monkeypatch.setitem(benchmark.DECODE_IMPLEMENTATIONS, "wrong", wrong)
    cells = benchmark.run_decode(shapes[:1], impls=("cupyflash", "wrong"), device="cpu", report=messages.append)
    assert cells[1].note == "ValueError: its output disagrees with cupyflash's" and math.isnan(cells[1].ms)


def test_an_interrupted_run_keeps_the_shapes_it_finished(monkeypatch):
    """Ctrl-C (or a time limit's SIGINT) in the third shape: the first two shapes' cells come back."""
    pytest.importorskip("torch")
    shapes = [benchmark.DecodeShape(2, 64, 4, 2, 32, 1, "dense"), benchmark.DecodeShape(2, 32, 4, 4, 16, 1, "dense"),
              benchmark.DecodeShape(1, 48, 2, 1, 32, 2, "dense")]
    plain = benchmark.DECODE_IMPLEMENTATIONS["SDPA flash (FA2)"]

    def interrupted_at_the_third(shape, q, k, v, generator):
        if shape == shapes[2]:
            raise KeyboardInterrupt
        return plain(shape, q, k, v, generator)
    monkeypatch.setitem(benchmark.DECODE_IMPLEMENTATIONS, "interrupted", interrupted_at_the_third)
    messages = []
    cells = benchmark.run_decode(shapes, impls=("cupyflash", "interrupted"), device="cpu", report=messages.append)
    assert [(c.shape, c.impl) for c in cells] == [(s, i) for s in shapes[:2] for i in ("cupyflash", "interrupted")]
    assert messages[-1] == "decode: interrupted after 2 of 3 shapes"


def test_the_table_has_ratios_fractions_and_footnotes(tmp_path):
    shape, other = benchmark.DecodeShape(16, 8192, 32, 8, 128, 1, "dense"), benchmark.DecodeShape(
        16, 8192, 32, 8, 128, 1, "paged16")
    ms = shape.kv_bytes / 3.0e12 * 1e3  # 3 TB/s
    cells = [benchmark.DecodeCell(shape, "cupyflash", ms), benchmark.DecodeCell(shape, "SDPA flash (FA2)", 2 * ms),
             benchmark.DecodeCell(shape, "SDPA cuDNN", math.nan, "RuntimeError: no cuDNN"),
             benchmark.DecodeCell(other, "cupyflash", math.nan, "NotImplementedError: no kernels"),
             benchmark.DecodeCell(other, "SDPA flash (FA2)", ms), benchmark.DecodeCell(other, "SDPA cuDNN", ms / 2)]
    markdown = benchmark.write_decode(cells, str(tmp_path), "NVIDIA H200; made up", 4.24)
    assert "| 16 | 8192 | 32/8 | 128 | 1 | dense | 3.00 | 1.50 | - (1) | 2.00 | 0.71 |" in markdown
    assert "| 16 | 8192 | 32/8 | 128 | 1 | paged16 | - (2) | 3.00 | 6.00 |  |  |" in markdown
    assert "(1) SDPA cuDNN: RuntimeError: no cuDNN" in markdown and "(2) cupyflash: NotImplementedError" in markdown
    with open(tmp_path / "decode.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and rows[0]["impl"] == "cupyflash" and float(rows[0]["tbps"]) == pytest.approx(3.0)


@pytest.mark.skipif(_arrays.gpu_available(), reason="a GPU is present: bench would run")
def test_bench_decode_without_a_gpu_says_so_in_one_line(tmp_path):
    code, out, err = run("bench", "--decode", "--decode-batches", "1", "--out", str(tmp_path / "results"))
    assert code == 1 and out.startswith("bench times the kernels on a GPU: ") and len(out.splitlines()) == 1
    assert "Traceback" not in err and not (tmp_path / "results").exists()


@pytest.mark.gpu
def test_decode_cells_are_timed_as_graph_replays_on_the_gpu():
    """Every implementation's step captures in a CUDA graph and its replays give a time; a step that
    cannot be captured gets a blank cell with its reason."""
    torch = pytest.importorskip("torch")
    shapes = [benchmark.DecodeShape(4, 1024, 8, 2, 128, 1, "dense"), benchmark.DecodeShape(2, 512, 4, 4, 64, 2, "paged16")]
    messages = []
    cells = benchmark.run_decode(shapes, impls=("cupyflash", "SDPA flash (FA2)"), reps=3, report=messages.append)
    ours = [c for c in cells if c.impl == "cupyflash"]
    assert len(ours) == 2 and all(not c.note and 0 < c.ms < 10 and c.tbps > 0 for c in ours), [(c.ms, c.note) for c in ours]

    def uncapturable(shape, q, k, v, generator):
        def step():
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("this step reads the device on the host")
            return q * 2
        return step
    benchmark.DECODE_IMPLEMENTATIONS["uncapturable"] = uncapturable
    try:
        cells = benchmark.run_decode(shapes[:1], impls=("uncapturable",), reps=1, report=messages.append)
    finally:
        del benchmark.DECODE_IMPLEMENTATIONS["uncapturable"]
    assert math.isnan(cells[0].ms) and "reads the device on the host" in cells[0].note, cells[0]


def test_the_decode_profile_runs_each_implementation_once_checked_on_cpu(monkeypatch, capsys):
    """bench/decode_profile.py (for ncu) on CPU tensors: each implementation's step is checked against
    cupyflash's and named in the order its profiled range comes; one that disagrees stops it."""
    pytest.importorskip("torch")
    import os
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
    import decode_profile
    impls = ["cupyflash", "SDPA flash (FA2)"]
    decode_profile.main(["--device", "cpu", "--impl", impls[0], "--impl", impls[1], "2:64:4:2:64:dense",
                         "1:64:4:1:64:paged16"])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"profiled: {label} {impl}" for label in ("b2 cache64 h4/2 d64 sq1 dense",
                                                              "b1 cache64 h4/1 d64 sq1 paged16") for impl in impls]
    monkeypatch.setitem(benchmark.DECODE_IMPLEMENTATIONS, "wrong", lambda shape, q, k, v, generator: lambda: q * 0 + 1)
    with pytest.raises(SystemExit, match="wrong disagrees"):
        decode_profile.main(["--device", "cpu", "--impl", "cupyflash", "--impl", "wrong", "2:64:4:2:64:dense"])


def test_the_attention_profile_names_each_call_it_profiles(monkeypatch, capsys):
    """bench/attn_profile.py (for ncu) on CPU tensors: each implementation's call of each cell runs
    and is named in the order its profiled range comes; a malformed cell is refused by name."""
    pytest.importorskip("torch")
    import os
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
    import attn_profile
    calls = []

    def fake(q, k, v, dout, causal):
        record = lambda pass_: lambda: calls.append((pass_, q.shape, causal))  # noqa: E731
        return benchmark.Calls({p: (record(p), None) for p in ("fwd", "bwd")}, None)
    monkeypatch.setitem(benchmark.IMPLEMENTATIONS, "fake", fake)
    attn_profile.main(["--device", "cpu", "--tokens", "64", "--impl", "fake", "fwd:64:32:causal", "bwd:128:64"])
    assert capsys.readouterr().out.splitlines() == ["profiled: fwd hd64 s32 causal fake", "profiled: bwd hd128 s64 fake"]
    assert calls == [("fwd", (2, 32, 32, 64), True)] * 4 + [("bwd", (1, 64, 16, 128), False)] * 4
    with pytest.raises(SystemExit):
        attn_profile.main(["--device", "cpu", "fwd:64:1024:sideways"])
    assert "a cell is PASS:HD:SEQLEN[:causal], got 'fwd:64:1024:sideways'" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_copy_rate_is_measured_in_a_plausible_range():
    """The decode table's fractions are of the copy rate measured in the run: bytes read and
    written over the median copy's time, somewhere between a PCIe card's and an H200's."""
    assert 0.5 < benchmark.measure_copy_tbps(256 << 20, reps=5) < 6.0
