"""The command line as a newcomer meets it, without a GPU: --version, info, a bad CUPYFLASH_TILES,
bench --help, and the one-line hints for what is missing."""

import subprocess
import sys

import pytest

from cupyflash import __main__, __version__, _arrays, _compile, _config


def run(*args, env=None):
    """(exit code, stdout, stderr) of `python -m cupyflash ARGS` in a fresh process."""
    result = subprocess.run([sys.executable, "-m", "cupyflash", *args], capture_output=True, text=True,
                            timeout=120, env=env)
    return result.returncode, result.stdout, result.stderr


@pytest.fixture
def env(monkeypatch, tmp_path):
    """The environment of a child process, with its own (empty) kernel cache."""
    import os
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUPYFLASH_TILES", raising=False)
    return os.environ.copy()


def test_version():
    code, out, _ = run("--version")
    assert code == 0 and out.strip() == f"cupyflash {__version__}"


@pytest.mark.skipif(_arrays.gpu_available(), reason="shows the device's own tiles where there is a GPU")
def test_info_without_a_gpu_shows_every_tile_table_and_the_cache(env, tmp_path):
    code, out, err = run("info", env=env)
    assert code == 0, err
    assert f"cupyflash {__version__}" in out
    assert f"kernel cache: {tmp_path / 'cache'} (0 files" in out and f"rm -rf {tmp_path / 'cache'}" in out
    for family in _config.FAMILIES:
        assert f"tile table {family}:" in out
    assert "128x32, 4 warps, 2 stage(s), 64 KiB" in out  # sm90's forward tile at head dim 128
    header = next(line for line in out.splitlines() if line.startswith("head dim"))
    assert header.count(" | ") == len(_config.TABLES)  # a column per tile table
    assert "decode tile of calls of at most a CTA per SM" in header
    # the wgmma tables, each once: the passes', then the forward's by length and by masking, the
    # backward's by options and by edges
    for line in ("the fwd pass up to head dim 256 is wgmma's", "the bwd pass up to head dim 256 is wgmma's",
                 f"its calls of at most {_config.SHORT_SEQLEN} query rows take: wgmma hd64: 128x128",
                 "its causal or windowed calls take: wgmma hd128: 128x128, 12 warps, 2 stage(s)",
                 "its calls without score options, causal or window edges or varlen take: wgmma hd128: 80x128"):
        assert out.count(line) == 1, line
    assert out.count("is wgmma's") == 2  # (the subsidiary tables are not passes of their own)


@pytest.mark.skipif(_arrays.gpu_available(), reason="shows the device's own tiles where there is a GPU")
def test_info_shows_the_forced_family_only(env, monkeypatch):
    env["CUPYFLASH_TILES"] = "sm86"
    code, out, _ = run("info", env=env)
    assert code == 0 and "tile table sm86 (forced by CUPYFLASH_TILES):" in out
    assert "sm90" not in out


@pytest.mark.parametrize("command", ["info", "check", "bench"])
def test_an_unknown_tile_family_is_a_one_line_error(command, env):
    env["CUPYFLASH_TILES"] = "bogus"
    code, out, err = run(command, env=env)
    assert code != 0
    assert err.strip() == "cupyflash: CUPYFLASH_TILES must be one of ['sm80', 'sm86', 'sm90', 'sm100', 'sm120'], got 'bogus'"
    assert out == "" and "Traceback" not in err


def test_bench_help_documents_every_option_and_its_default():
    code, out, _ = run("bench", "--help")
    assert code == 0
    options = [a for a in __main__._parser()._subparsers._group_actions[0].choices["bench"]._actions
               if a.option_strings and a.dest != "help"]
    assert len(options) == 18
    help_text = " ".join(out.split())
    for option in options:
        assert option.option_strings[0] in help_text
        assert "(default: " in " ".join(option.help.split())
    assert "(default: [64, 128, 256])" in help_text and "(default: bench/results)" in help_text


# ------------------------------------------------------------------------------------------- hints

def test_a_missing_cupy_gives_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    for hint in (_arrays.missing_cupy(), _arrays.missing_nvrtc(), _arrays.missing_gpu()):
        assert hint == 'CuPy is not installed: pip install -e ".[cuda13]" (or ".[cuda12]" for a CUDA 12 driver)'
    assert not _arrays.gpu_available()


@pytest.fixture
def without_nvrtc(monkeypatch):
    """CuPy present, its NVRTC library not (CuPy raises a RuntimeError subclass when no libnvrtc loads)."""
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc, runtime

    def missing():
        raise RuntimeError('Failure finding "libnvrtc.so.13 or libnvrtc.so.12"')
    monkeypatch.setattr(nvrtc, "getVersion", missing)
    monkeypatch.setattr(runtime, "runtimeGetVersion", lambda: 13000)
    _compile.nvrtc_version.cache_clear()  # it caches the real version
    yield
    _compile.nvrtc_version.cache_clear()


def test_a_missing_nvrtc_gives_one_line_naming_the_extra(without_nvrtc):
    hint = _arrays.missing_nvrtc()
    assert hint == ('NVRTC, the CUDA runtime compiler, is not installed (CuPy found no libnvrtc.so.13): '
                    'pip install -e ".[cuda13]"')
    with pytest.raises(_arrays.SetupError) as raised:
        _compile.nvrtc_version()
    assert str(raised.value) == hint


def test_check_without_nvrtc_prints_the_hint_not_a_traceback(without_nvrtc, monkeypatch, capsys):
    monkeypatch.setattr(__main__, "missing_gpu", lambda: "no GPU (simulated)")
    monkeypatch.setattr(__main__, "_check_numpy", lambda: 0)
    assert __main__.main(["check"]) == 1
    out = capsys.readouterr().out
    assert 'cannot compile the kernels: NVRTC, the CUDA runtime compiler, is not installed' in out
    assert "Traceback" not in out


def test_a_compile_without_nvrtc_raises_the_hint_before_starting_workers(without_nvrtc):
    with pytest.raises(_arrays.SetupError, match=r'^NVRTC, .* pip install -e "\.\[cuda13\]"$'):
        _compile.compile_all([("90", None)])


def test_a_driver_older_than_the_cupy_wheel_names_the_cuda12_extra(monkeypatch):
    pytest.importorskip("cupy")
    from cupy.cuda import runtime

    def insufficient():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")
    monkeypatch.setattr(runtime, "getDeviceCount", insufficient)
    monkeypatch.setattr(runtime, "driverGetVersion", lambda: 12040)
    monkeypatch.setattr(runtime, "runtimeGetVersion", lambda: 13000)
    assert _arrays.missing_gpu() == ('the NVIDIA driver supports CUDA 12.4, older than the CUDA 13 that cupy-cuda13x '
                                     'needs: pip uninstall -y cupy-cuda13x && pip install -e ".[cuda12]"')
    monkeypatch.setattr(runtime, "driverGetVersion", lambda: 11080)
    assert _arrays.missing_gpu().endswith("needs: install an NVIDIA driver for CUDA 12 or newer")


def test_default_check_compiles_a_small_set_covering_every_table_and_dtype():
    from cupyflash import _kernels
    jobs = _kernels.representative_jobs(_kernels.compile_jobs())
    assert len(jobs) <= 127  # (a distinct tile in each table: one kernel each; the bias tiles' kernels)
    # the light options' backwards (_kernels.LIGHT_FEATURES: their own code), in each family
    assert {(k.features, k.wgmma) for _, k in jobs if k.pass_ == "bwd" and k.features in _kernels.LIGHT_FEATURES} == {
        (features, wgmma) for features in _kernels.LIGHT_FEATURES for wgmma in (False, True)}
    # softcap alone in bfloat16, whose forwards hold the fixed maximum's code (_kernels._BOUNDED_FLAGS), once per family
    assert sorted(k.wgmma for _, k in jobs if k.features == ("softcap",) and k.dtype == "bfloat16") == [False, True]
    assert {arch for arch, _ in jobs} == {arch for archs in _config.COMPILE_CHECKS.values() for arch in archs}
    wgmma = [k for _, k in jobs if k.wgmma]  # every tile, with its heaviest flags
    assert {k.tile.headdim for k in wgmma if k.local and k.options} == set(_config.TILES[_config.WGMMA]["sm90"]["fwd"])
    assert {k.tile.headdim for k in wgmma if k.local and k.options and k.pass_ == "bwd"} == set(
        _config.TILES[_config.WGMMA]["sm90"]["bwd"])
    assert {k.dtype for _, k in jobs} == set(_kernels.DTYPES)
    sm90 = [k for arch, k in jobs if arch == "90" and k.tile is not None]  # the mma.sync kernels
    for table in _config.TABLES:  # every tile of sm_90's own tables
        for hd, cfg in _config.TILES[_config.MMA_SYNC]["sm90"][table].items():
            with_options = table == "bwd_options" or None
            assert any(k.tile == _config.Tile(hd, *cfg) and k.pass_ == _config.kernel_pass(table)
                       and (with_options is None or k.options) for k in sm90), (table, hd)
    flags = {(k.local, k.even_k, k.options) for k in sm90 if k.pass_ == "fwd"}
    assert len(flags) == 8
    assert [k.tile.block_n for k in sm90 if k.kv_heads] == [32]  # a decode tile of several kv heads, once


def test_a_compile_worker_without_nvrtc_sends_back_the_hint(without_nvrtc):
    """What a worker process runs: a missing NVRTC comes back to the parent as the hint's SetupError."""
    from cupyflash import _kernels
    with pytest.raises(_arrays.SetupError, match=r'^NVRTC, .* pip install -e "\.\[cuda13\]"$'):
        _compile._compile_for_report(_kernels.Kernel("bwd_dot", "float16"), "90")
