"""bench/fa4_sass.py's plumbing without FA4: the Python it runs is a stand-in that leaves cubins
named as CuTe-DSL names them, so the choice of the main kernel's cubin and the refusals run here."""
import os
import pathlib
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import fa4_sass  # noqa: E402

NAMES = {"fwd": ["cutlass___call___flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at_0.sm_90a.cubin"],
         "bwd": ["cutlass___call___flash_attncuteflash_bwd_preprocessFlashAttentionBackwardPreprocess_0.sm_90a.cubin",
                 "cutlass___call___flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at_0.sm_90a.cubin",
                 "cutlass___call___flash_attncuteflash_bwd_postprocessFlashAttentionBackwardPostprocess_0.sm_90a.cubin"]}


def _stand_in(tmp_path, names, exit_code=0):
    """An executable that, run as FA4_PYTHON, writes `names` into CUTE_DSL_DUMP_DIR and checks the target."""
    script = tmp_path / "python"
    files = " ".join(f'"$CUTE_DSL_DUMP_DIR/{name}"' for name in names)
    script.write_text(f'#!/bin/sh\n[ "$CUTE_DSL_ARCH" = sm_90a ] || exit 3\ntouch {files}\n'
                      f'echo "a compile error" >&2\nexit {exit_code}\n')
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_the_main_kernels_cubin_is_found_among_the_others(tmp_path, pass_):
    out = tmp_path / "out"
    out.mkdir()
    cubin = fa4_sass.compile_fa4(_stand_in(tmp_path, NAMES[pass_]), pass_, 128, False, out)
    assert cubin.name == NAMES[pass_][len(NAMES[pass_]) // 2]


def test_a_failed_compile_and_a_missing_cubin_are_said(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SystemExit, match="FA4 did not compile:\na compile error"):
        fa4_sass.compile_fa4(_stand_in(tmp_path, NAMES["fwd"], exit_code=1), "fwd", 64, True, out)
    with pytest.raises(SystemExit, match="expected one flash_bwd_sm90 cubin"):
        fa4_sass.compile_fa4(_stand_in(tmp_path, NAMES["fwd"]), "bwd", 64, True, pathlib.Path(out))


def test_fa4_python_must_be_named(monkeypatch):
    monkeypatch.delenv("FA4_PYTHON", raising=False)
    with pytest.raises(SystemExit, match="set FA4_PYTHON"):
        fa4_sass.main(["fwd", "128"])
