"""`bench --host` without a GPU: the table it writes from made-up figures, its flags, its one-line
refusal, and each column's calls on CPU tensors (the figures mean nothing there; the plumbing does)."""

import csv
import math
import subprocess
import sys

import pytest

from cupyflash import _arrays, benchmark

SMALL, MEDIUM = (1, 128, 8, 64), (4, 512, 16, 128)


def run(*args):
    """(exit code, stdout, stderr) of `python -m cupyflash ARGS` in a fresh process."""
    result = subprocess.run([sys.executable, "-m", "cupyflash", *args], capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout, result.stderr


def _cells():
    nan, cells = math.nan, []
    for shape, scale in ((SMALL, 1), (MEDIUM, 2)):
        for pass_, factor in (("fwd", 1), ("fwd+bwd", 4)):
            cells += [benchmark.HostCell(shape, pass_, "cupyflash core (CuPy)", 15.0 * scale * factor),
                      benchmark.HostCell(shape, pass_, "cupyflash.torch eager", 30.0 * scale * factor)]
            if pass_ == "fwd":
                cells.append(benchmark.HostCell(shape, pass_, "cupyflash.torch fwd (no grad)", 25.0 * scale))
            cells += [benchmark.HostCell(shape, pass_, "cupyflash.torch reduce-overhead", 12.0 * scale * factor,
                                         "CUDA graphs skipped (TORCH_LOGS=cudagraphs says why)"),
                      benchmark.HostCell(shape, pass_, "cupyflash.jax jit", 40.0 * scale * factor),
                      benchmark.HostCell(shape, pass_, "SDPA flash", 20.0 * scale * factor),
                      benchmark.HostCell(shape, pass_, "JAX cuDNN", nan, "ImportError: No module named 'jax'"
                                         if scale == 1 else "RuntimeError: no cuDNN")]
    return cells


def test_write_host_makes_one_row_per_shape_and_pass_with_ratios_and_footnotes(tmp_path):
    markdown = benchmark.write_host(_cells(), str(tmp_path), "NVIDIA H200; torch 2.9, jax missing; 2026-12-01", 200)
    assert (tmp_path / "host.md").read_text() == markdown
    lines = markdown.splitlines()
    assert lines[0] == "# Host time per call" and lines[2] == "NVIDIA H200; torch 2.9, jax missing; 2026-12-01"
    assert "the wall time of 200 back-to-back calls" in markdown and f"the median of its {benchmark.HOST_REPS} turns" in markdown
    assert markdown.count("Targets: ") == 1 and "<= 20 us at 1x128x8x64" in markdown
    header = ("| shape | pass | cupyflash core (CuPy) | cupyflash.torch eager | cupyflash.torch fwd (no grad) | "
              "cupyflash.torch reduce-overhead | cupyflash.jax jit | SDPA flash | JAX cuDNN | "
              "cupyflash.torch eager / SDPA flash | cupyflash.jax jit / JAX cuDNN |")
    start = lines.index(header)
    assert lines[start + 1] == "|" + "---|" * 11
    assert lines[start + 2:start + 6] == [
        "| 1x128x8x64 | fwd | 15.0 | 30.0 | 25.0 | 12.0 (1) | 40.0 | 20.0 | - (2) | 1.50 |  |",
        "| 1x128x8x64 | fwd+bwd | 60.0 | 120.0 |  | 48.0 (1) | 160.0 | 80.0 | - (2) | 1.50 |  |",
        "| 4x512x16x128 | fwd | 30.0 | 60.0 | 50.0 | 24.0 (1) | 80.0 | 40.0 | - (3) | 1.50 |  |",
        "| 4x512x16x128 | fwd+bwd | 120.0 | 240.0 |  | 96.0 (1) | 320.0 | 160.0 | - (3) | 1.50 |  |"]
    assert lines[start + 6] == ""
    assert "- cupyflash.torch fwd (no grad): the same forward on tensors that do not require grad (fwd only)" in lines
    assert lines[-3:] == ["(1) cupyflash.torch reduce-overhead: CUDA graphs skipped (TORCH_LOGS=cudagraphs says why)",
                          "(2) JAX cuDNN: ImportError: No module named 'jax'",
                          "(3) JAX cuDNN: RuntimeError: no cuDNN"]

    with open(tmp_path / "host.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["batch", "seqlen", "nheads", "headdim", "pass", "column", "us", "note"]
    assert len(rows) == 1 + len(_cells())
    assert ["1", "128", "8", "64", "fwd", "cupyflash core (CuPy)", "15.00", ""] in rows
    assert ["4", "512", "16", "128", "fwd+bwd", "JAX cuDNN", "", "RuntimeError: no cuDNN"] in rows


def test_host_shapes_are_names_or_b_x_s_x_h_x_d():
    assert benchmark.host_shape("small") == SMALL
    assert benchmark.host_shape("large") == (8, 2048, 16, 128)
    assert benchmark.host_shape("2x256x8x64") == (2, 256, 8, 64)
    for bad in ("tiny", "2x256x8", "2x256x8x0", "2x256x8x-64"):
        with pytest.raises(ValueError, match="small, medium, large or BxSxHxD"):
            benchmark.host_shape(bad)


@pytest.mark.parametrize("args, message", [
    (("--host-shapes", "small", "2x3"), "argument --host-shapes: a host shape is one of small, medium, large"),
    (("--host-calls", "0"), "argument --host-calls: a positive integer, got '0'"),
    (("--profile", "torch eager"), "argument --profile: invalid choice: 'torch eager'"),
])
def test_bad_host_flags_stop_before_anything_runs(args, message):
    code, out, err = run("bench", "--host", *args)
    assert code == 2 and out == "" and message in err and "Traceback" not in err


@pytest.mark.skipif(_arrays.gpu_available(), reason="times the host where there is a GPU")
@pytest.mark.parametrize("args", [("--host",), ("--profile", "cupyflash.torch eager", "--host-shapes", "small")])
def test_bench_host_without_a_gpu_says_so_in_one_line_and_writes_nothing(args, tmp_path):
    code, out, err = run("bench", *args, "--out", str(tmp_path / "results"))
    assert code == 1 and out.startswith("bench times the kernels on a GPU: ") and len(out.splitlines()) == 1
    assert "Traceback" not in err and not (tmp_path / "results").exists()


def test_every_column_times_its_calls_or_gives_its_reason_on_cpu_tensors():
    pytest.importorskip("torch")
    messages = []
    cells = benchmark.run_host([(1, 16, 2, 16)], calls=2, device="cpu", report=messages.append)
    columns = list(benchmark.HOST_COLUMNS)
    assert [(c.pass_, c.column) for c in cells] == (
        [("fwd", c) for c in columns] + [("fwd+bwd", c) for c in columns if c != "cupyflash.torch fwd (no grad)"])
    for cell in cells:
        assert cell.note or not math.isnan(cell.us), cell
    by_column = {(c.pass_, c.column): c for c in cells}
    # The eager torch paths run on the CPU (cupyflash.torch through the NumPy reference); the core
    # takes no CPU torch tensors; torch.compile's runs where inductor finds a C++ compiler, and on
    # the CPU without CUDA graphs.
    for column in ("cupyflash.torch eager", "SDPA flash", "torch Function floor"):
        assert by_column["fwd+bwd", column].us > 0
    assert by_column["fwd", "cupyflash.torch fwd (no grad)"].us > 0
    assert math.isnan(by_column["fwd", "cupyflash core (torch)"].us)
    graphs = by_column["fwd", "cupyflash.torch reduce-overhead"]
    assert math.isnan(graphs.us) or graphs.note.startswith("CUDA graphs skipped")
    assert len(messages) == len(cells) and messages[0].startswith("host 1x16x2x16 fwd cupyflash core (CuPy): ")


def test_a_profile_reports_microseconds_per_call_by_function():
    pytest.importorskip("torch")
    messages = []
    benchmark.run_host([(1, 16, 2, 16)], calls=3, columns=["cupyflash.torch eager"], profile=True, device="cpu",
                       report=messages.append)
    assert len(messages) == 4
    assert messages[0].startswith("host 1x16x2x16 fwd cupyflash.torch eager: ")
    assert messages[2].startswith("host 1x16x2x16 fwd+bwd cupyflash.torch eager: ")
    for profile in messages[1::2]:
        assert profile.splitlines()[0] == "  own us   cum us   runs  function (per call, 3 calls)"
        assert len(profile.splitlines()) == 26
    assert "cupyflash/torch.py:" in messages[1] and "run_backward" in messages[3]
