"""The benchmark's bookkeeping: a peer's wrong results left blank, turns, derived backward times; bench/ab.py's cells;
bench/power.py's runs and samples."""

import collections

import pytest

from cupyflash import benchmark


def _calls_returning(out, grads):
    return benchmark.Calls({}, lambda: (out, grads))


def test_wrong_results_accepts_rounding_and_flags_wrong_or_nonfinite_passes():
    torch = pytest.importorskip("torch")  # CPU tensors are enough; skips where torch is not installed
    generator = torch.Generator().manual_seed(0)
    out, dq, dk, dv = (torch.randn(2, 64, 4, 32, generator=generator) for _ in range(4))
    expected = (out, (dq, dk, dv))
    rounded = lambda x: x.to(torch.bfloat16)  # noqa: E731  what a second correct 16-bit kernel differs by
    assert benchmark._wrong_results(_calls_returning(rounded(out), [rounded(g) for g in (dq, dk, dv)]), expected) == set()

    nan_dq = dq.clone()
    nan_dq[1, 7, 2, 3] = float("nan")
    assert benchmark._wrong_results(_calls_returning(out, [nan_dq, dk, dv]), expected) == {"bwd", "fwd+bwd"}
    assert benchmark._wrong_results(_calls_returning(out, [dq, dk, dv * 3]), expected) == {"bwd", "fwd+bwd"}
    assert benchmark._wrong_results(_calls_returning(out.flip(1), [dq, dk, dv]), expected) == {"fwd", "fwd+bwd"}


@pytest.mark.parametrize("n", range(1, 10))
def test_balanced_order_puts_each_timer_in_every_position_and_after_every_other_equally_often(n):
    cycle = [benchmark.balanced_order(list(range(n)), r) for r in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(order) == list(range(n)) for order in cycle)
    positions = collections.Counter((timer, i) for order in cycle for i, timer in enumerate(order))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    pairs = collections.Counter(pair for order in cycle for pair in zip(order, order[1:]))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1
    assert benchmark.balanced_order(list(range(n)), len(cycle)) == cycle[0]  # the cycle repeats
    names = "abcdefghi"[:n]  # any items, in the order of their indices'
    assert benchmark.balanced_order(list(names), 1) == [names[i] for i in cycle[1 % len(cycle)]]


def test_median_ms_takes_turns_in_balanced_orders_and_leaves_out_a_timer_that_fails():
    order, messages = [], []

    class Timer:
        def __init__(self, name, values):
            self.name, self.values = name, iter(values)

        def batch_ms(self):
            order.append(self.name)
            value = next(self.values)
            if value is None:
                raise RuntimeError("out of memory")
            return value

    reps = 6
    timers = {"a": Timer("a", [3.0, 1.0, 2.0, 8.0, 2.0, 2.5]), "b": Timer("b", [5.0, 9.0, 4.0, 4.0, 6.0, 5.0]),
              "c": Timer("c", [1.0, None]), "d": Timer("d", [1.0] * reps)}
    assert benchmark.median_ms(timers, reps=reps, report=messages.append) == {"a": 2.25, "b": 5.0, "d": 1.0}
    assert len(messages) == 1 and "c" in messages[0] and "out of memory" in messages[0]
    # every round times each remaining timer once, and the rounds' orders are not all the same
    rounds, rest = [order[:4], order[4:8]], order[8:]
    rounds += [rest[i:i + 3] for i in range(0, len(rest), 3)]
    assert [sorted(r) for r in rounds] == [list("abcd")] * 2 + [list("abd")] * (reps - 2)
    assert len({tuple(r) for r in rounds[2:]}) > 1
    assert benchmark.median_ms({"c": Timer("c", [None])}, reps=3, report=messages.append) == {}  # none left


def test_a_backward_without_its_own_timer_is_derived_from_fwd_and_fwd_bwd():
    timers = {("jax", "fwd"): None, ("jax", "fwd+bwd"): None, ("torch", "fwd"): None, ("torch", "bwd"): None,
              ("torch", "fwd+bwd"): None, ("slow", "fwd"): None, ("slow", "fwd+bwd"): None}
    times = {("jax", "fwd"): 1.0, ("jax", "fwd+bwd"): 3.5, ("torch", "fwd"): 1.0, ("torch", "fwd+bwd"): 3.0,
             ("slow", "fwd"): 2.0}  # torch's bwd timer failed while timed; slow's fwd+bwd too
    for impl in ("jax", "torch", "slow", "missing"):
        benchmark._add_derived_bwd(times, timers, impl)
    assert times[("jax", "bwd")] == 2.5
    assert ("torch", "bwd") not in times and ("slow", "bwd") not in times and ("missing", "bwd") not in times


def _bench_script(name):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_interrupted_speed_run_keeps_the_cells_it_finished(monkeypatch):
    """Ctrl-C (or a time limit's SIGINT) in the third cell: the first two cells' rows come back."""
    cells = benchmark.speed_cells((64,), (1024, 4096), ("bfloat16",))
    assert cells == [("bfloat16", 64, 1024, False), ("bfloat16", 64, 1024, True),
                     ("bfloat16", 64, 4096, False), ("bfloat16", 64, 4096, True)]

    def cell(dtype, hd, seqlen, causal, impls, passes, missing, progress, report):
        if (seqlen, causal) == (4096, False):
            raise KeyboardInterrupt
        return [benchmark.Row(i, dtype, hd, seqlen, causal, p, 1.0, 1.0) for i in impls for p in passes]
    monkeypatch.setattr(benchmark, "_speed_cell", cell)
    messages = []
    rows = benchmark.run_speed((64,), (1024, 4096), ("bfloat16",), impls=("cupyflash", "SDPA cuDNN"),
                               passes=("fwd",), report=messages.append)
    assert [(r.seqlen, r.causal, r.impl) for r in rows] == [(1024, c, i) for c in (False, True)
                                                             for i in ("cupyflash", "SDPA cuDNN")]
    assert messages == ["speed: interrupted after 2 of 4 cells"]


def test_device_trees_makes_a_tree_per_version_with_its_patches(tmp_path):
    trees = _bench_script("device_trees")
    if not (trees.REPO / ".git").exists():
        pytest.skip("not a git checkout")
    patch = tmp_path / "note.patch"
    patch.write_text("--- a/setup.cfg\n+++ b/setup.cfg\n@@ -1 +1,2 @@\n+# patched\n "
                     + (trees.REPO / "setup.cfg").read_text().splitlines()[0] + "\n")
    plain = trees.make_tree(tmp_path, "plain=HEAD")
    patched = trees.make_tree(tmp_path, f"patched=HEAD+{patch}")
    assert (plain / "cupyflash" / "api.py").exists() and (plain / "cuda_src" / "sm90" / "fwd.cuh").exists()
    assert (patched / "setup.cfg").read_text().startswith("# patched\n")
    assert not (plain / "setup.cfg").read_text().startswith("# patched")
    with pytest.raises(SystemExit, match="NAME=REV"):
        trees.make_tree(tmp_path, "HEAD")


def test_the_ab_script_reads_decode_cells_and_compiles_the_kvcache_kernels():
    ab = _bench_script("ab")
    assert ab.parse_decode_cell("128:1024:32:8:128:dense") == (128, 1024, 32, 8, 128, 0)
    assert ab.parse_decode_cell("1:4096:8:1:64:paged16") == (1, 4096, 8, 1, 64, 16)
    assert all(ab.parse_decode_cell(cell) for cell in ab.DECODE_CELLS)
    for bad in ("128:1024:32:8:128", "128:1024:30:8:128:dense", "1:1000:8:1:64:paged16", "1:1024:8:1:64:paged24",
                "1:1024:8:1:96:dense", "1:1024:8:1:64:tiled", "0:1024:8:1:64:dense"):
        with pytest.raises(ValueError, match="a decode cell is"):
            ab.parse_decode_cell(bad)
    passes = {k.pass_ for _, k in ab.compile_jobs("decode", "bfloat16", {})}
    assert passes == {"decode", "decode_combine", "kvcache_append"}


def test_the_ab_script_reads_cells_and_picks_the_kernels_the_h200_runs():
    ab = _bench_script("ab")
    assert ab.parse_cell("128:4096:1") == (128, 4096, True, 4) and len(ab.ALL_CELLS) == 18
    assert ab.parse_cell("128:512:1:2048") == (128, 512, True, 4)  # (batch x seqlen = the tokens given)
    for bad in ("128:1000:1", "128:4096:2", "100:4096:0", "128:512:1:1000", "128:512:1:2048:0"):
        with pytest.raises(ValueError, match="a cell is hd:seqlen:causal"):
            ab.parse_cell(bad)
    fwd = ab.compile_jobs("fwd", "bfloat16", {})  # the wgmma forward's plain and causal kernels, no others
    assert {(arch, k.tile.headdim, k.local) for arch, k in fwd} == {
        ("90a", hd, local) for hd in (64, 128, 256) for local in (False, True)} and not any(k.options for _, k in fwd)
    with_options = ab.compile_jobs("fwd", "bfloat16", {"softcap": 30.0, "dropout_p": 0.1, "seed": 1})
    assert [(arch, k.tile, k.local) for arch, k in with_options] == [(arch, k.tile, k.local) for arch, k in fwd]
    assert {k.features for _, k in with_options} == {("softcap", "dropout")}
    bwd = ab.compile_jobs("bwd", "float16", {})
    assert bwd and all(k.pass_ != "fwd" and k.dtype == "float16" and not k.options for _, k in bwd)


@pytest.mark.parametrize("cell, split_rows, heads, splits", [
    ("1:16384:32:8:64:paged256", None, 1, 16),   # (v69: four heads' splits of 1024 rows ran 11% slower)
    ("2:16384:32:8:64:paged256", None, 1, 8),
    ("3:4352:192:48:64:paged256", None, 1, 1),
    ("3:4352:192:48:64:paged256", 4096, 4, 3),   # four heads split 3 ways: 5803 rows a split
    ("1:131072:32:8:64:paged256", None, 4, 66)])
def test_the_decode_plans_of_a_modelled_h100(cell, split_rows, heads, splits, monkeypatch):
    """bench/decode_plans.py without a GPU: the kv heads a tile that an H100 chose in
    tests/test_kvcache_gpu.py's rule test (v69), from the kernels' registers read off their cubins.
    The `decode` tile holds one CTA an SM there (v69's first model assumed two, and missed)."""
    from cupyflash import _kvcache
    plans = _bench_script("decode_plans")
    if split_rows:
        monkeypatch.setattr(_kvcache, "HEADS_SPLIT_ROWS", split_rows)
    device = plans.modelled_device("h100")
    layout = plans.layout_of(cell, device)
    assert (layout.heads, layout.splits) == (heads, splits)
    if layout.tile.block_n == 16 and layout.tile.warps == 8:  # the 'decode' tile
        assert device.resident(layout.kernel) == 132


def test_the_power_script_reads_runs_and_takes_the_steady_samples():
    power = _bench_script("power")
    assert power.parse_run("cudnn:bwd:64:1") == ("cudnn", "bwd", 64, True, False)
    assert power.parse_run("cupyflash:fwd:128:0:dropout") == ("cupyflash", "fwd", 128, False, True)
    assert power.parse_run("fa4:fwd:128:0") == ("fa4", "fwd", 128, False, False)
    for run in power.DEFAULT_RUNS:
        power.parse_run(run)
    for bad in ("fa3:fwd:128:0", "cupyflash:dq:128:0", "cupyflash:fwd:100:0", "cupyflash:fwd:128:2",
                "cupyflash:fwd:128:0:softcap", "cupyflash:fwd:128", "fa4:fwd:128:0:dropout"):
        with pytest.raises(ValueError, match="a run is impl:pass:headdim:causal"):
            power.parse_run(bad)
    assert power.parse_seqlen("16384") == 16384
    for bad in ("0", "3000", "32768", "4k", ""):
        with pytest.raises(ValueError, match="--seqlen takes a whole number dividing 16384"):
            power.parse_seqlen(bad)
    # warm-up samples (the first) are left out; a line that is not 'clock, power' is skipped
    lines = ["1980, 300.5", "1980, 320.0", "[N/A]", "1680, 690.0", "1695, 688.0", "1665, 691.5"]
    assert power.steady_medians(lines, 3) == (1680.0, 690.0)
    with pytest.raises(RuntimeError, match="no samples"):
        power.steady_medians(["[N/A]"], 3)
    report = """  cupyflash_fwd_bfloat16_wgmma_hd128_m128_n128_s2_local (132, 1, 1)x(384, 1, 1), Context 1, Stream 7
    Section: Command line profiler metrics
    dram__bytes_read.sum          Gbyte         1.12
    dram__bytes_write.sum         Mbyte        57.23
    gpu__time_duration.sum           us       598.14"""
    assert power.ncu_bytes(report) == {"dram__bytes_read.sum": 1.12e9, "dram__bytes_write.sum": 57.23e6}
    assert power.ncu_bytes("==PROF== no kernels were profiled") == {}


def test_option_rows_are_selected_by_words_and_keep_the_plain_row():
    names = ["plain", "causal", "softcap 30", "attn_bias (b, h, s, s) bf16", "dropout 0.1"]
    assert benchmark.selected_options(names) == names
    assert benchmark.selected_options(names, ["attn_bias", "dropout"]) == [
        "plain", "attn_bias (b, h, s, s) bf16", "dropout 0.1"]
    assert benchmark.selected_options(names, ["nothing"]) == ["plain"]


def test_each_option_row_times_the_plain_kernels_in_its_own_turns(monkeypatch):
    torch = pytest.importorskip("torch")  # (no tensor is made: randn is replaced)
    monkeypatch.setattr(torch, "randn", lambda *shape, **kw: None)
    ms = {("plain", "fwd"): [1.0, 1.1], ("plain", "bwd"): [2.0, 2.2],  # each row's turns read their own clock
          ("softcap", "fwd"): [1.3], ("softcap", "bwd"): [2.6], ("peer", "fwd"): [2.5], ("peer", "bwd"): [5.0]}
    rows_timed = []

    class Timer:
        def __init__(self, fn, sync=None):
            self.key = fn

        def batch_ms(self):
            return ms[self.key][min(len(rows_timed) - 1, len(ms[self.key]) - 1)]

    def median(timers, reps=5, report=print):
        rows_timed.append(sorted(key for key in timers))
        return {key: timer.batch_ms() for key, timer in timers.items()}

    monkeypatch.setattr(benchmark, "BatchTimer", Timer)
    monkeypatch.setattr(benchmark, "median_ms", median)
    monkeypatch.setattr(benchmark, "_option_calls", lambda *args: {
        "plain": ({}, {}, "SDPA", None), "softcap 30": ({"softcap": 30.0}, {"softcap": 30.0}, "SDPA", None)})
    monkeypatch.setattr(benchmark, "_cupyflash_option", lambda q, k, v, dout, fwd, bwd: {
        pass_: ("softcap" if fwd else "plain", pass_) for pass_ in ("fwd", "bwd")})
    monkeypatch.setattr(benchmark, "_peer_option", lambda q, k, v, dout, spec: {
        pass_: (("peer", pass_), None) for pass_ in ("fwd", "bwd")})
    results = benchmark.run_options(seqlens=(4096,), report=lambda message: None)
    assert [row[:3] for row in results] == [("plain", 4096, "fwd"), ("plain", 4096, "bwd"),
                                            ("softcap 30", 4096, "fwd"), ("softcap 30", 4096, "bwd")]
    assert all(("plain", "fwd") in timed and ("plain", "bwd") in timed for timed in rows_timed)
    # the softcap row divides by the plain times of its own turns (1.1, 2.2), not the plain row's
    assert results[2][3:] == (1.3, "SDPA", 2.5, 1.1) and results[3][3:] == (2.6, "SDPA", 5.0, 2.2)
    assert results[0][6] == 1.0 and results[1][6] == 2.0


def test_option_ratios_divide_by_the_plain_time_of_their_own_row(tmp_path):
    nan = float("nan")
    results = [("plain", 4096, "fwd", 1.0, "SDPA flash (FA2)", 2.0, 1.02),
               ("dropout 0.1", 4096, "fwd", 1.5, "SDPA flash (FA2)", 3.0, 1.2),
               ("alibi", 4096, "bwd", 2.2, "", nan, 2.0)]
    text = benchmark.write_options(results, str(tmp_path))
    assert "| plain | 4096 | fwd | 1.000 | 0.98 | SDPA flash (FA2) | 2.000 | 2.00x |" in text
    assert "| dropout 0.1 | 4096 | fwd | 1.500 | 1.25 | SDPA flash (FA2) | 3.000 | 2.00x |" in text
    assert "| alibi | 4096 | bwd | 2.200 | 1.10 |  |  |  |" in text
    rows = (tmp_path / "options.csv").read_text().splitlines()
    assert rows[0] == "option,seqlen,pass,cupyflash_ms,peer,peer_ms,plain_ms"
    assert rows[2] == "dropout 0.1,4096,fwd,1.5000,SDPA flash (FA2),3.0000,1.2000"
