"""The benchmark's check of a peer's results: a pass with wrong results is left blank, not timed."""

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
