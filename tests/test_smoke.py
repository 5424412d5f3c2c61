"""The GPU smoke tier (`python -m pytest -m smoke tests`): a few small cases that together run every
kernel family once, forward and backward, under cupyflash/_check.py's rule against the float64
reference, plus one PyTorch and one JAX round trip. Meant to finish in well under a minute on an
H200, where compiling dominates: each distinct kernel variant costs NVRTC 2-5 s on a cold cache,
so the cases share variants wherever they can.

Kernel variants on an sm90 GPU (name parts: pass, dtype, tile head dim, LOCAL, EVEN_K, EXTRAS), 15:
  bwd_dot and bwd_convert_dq, each in float16 and bfloat16                             4
  plain       bf16 hd64 even_k, GQA 4/2:           fwd 128x64, bwd 128x128               2
  causal      fp16 hd40 (-> 64), MQA 6/1, rows that see no key: fwd, bwd (LOCAL)        2
  varlen      bf16 hd72 (-> 96), window softcap ALiBi dropout deterministic (LOCAL EXTRAS) 2
  attn_bias   fp16 hd128 even_k, dbias, softcap, deterministic (EXTRAS, two-stage fwd)  2
  sm80 table  bf16 hd64 (the forward is sm90's: shared with 'plain'): bwd 64x128        1
  sm86 table  fp16 hd128 causal: fwd 64x64, bwd 64x32 (LOCAL)                           2
  the backward's split last wave (TailSplit) and one key block reuse 'plain'; the torch round trip reuses
  'attn_bias', the JAX one 'varlen'                                                     0
"""

import zlib

import pytest

from cupyflash import _check, _config
from cupyflash._check import Case
from test_gpu import _is_backward

pytestmark = [pytest.mark.gpu, pytest.mark.smoke]

PLAIN = Case(200, 257, 64, "bfloat16", False, nheads=4, nheads_k=2)
CAUSAL = Case(257, 200, 40, "float16", True, nheads=6, nheads_k=1)
VARLEN = Case.packed((0, 17, 257, 113), (3, 150, 200, 0), 72, "bfloat16", False, nheads=4, nheads_k=2,
                     window_size=(37, 11), softcap=1.5, alibi_slopes=True, dropout_p=0.17, deterministic=True)
BIAS = Case(113, 200, 128, "float16", False, nheads=4, nheads_k=2, softcap=2.0, attn_bias="heads", deterministic=True)
# One key block: the backward stores dq itself, no bwd_convert_dq (the 'plain' variants).
ONE_KEY_BLOCK = Case(113, 100, 64, "bfloat16", False, nheads=4, nheads_k=2)
# CUPYFLASH_TILES forces an older family's tile table on this GPU.
FORCED = {"sm80": Case(150, 257, 64, "bfloat16", False, nheads=4, nheads_k=2),
          "sm86": Case(200, 200, 128, "float16", True, nheads=4, nheads_k=1)}
# 3 key blocks x 2 kv heads x batch 2 = 12 CTAs of 6 query steps; with 8 resident, _tail_split splits the
# last 4 in 2 pieces each.
TAIL_SPLIT = (Case(257, 257, 64, "bfloat16", False, nheads=4, nheads_k=2), 8)
TORCH_CASE = Case(113, 200, 128, "float16", False, nheads=4, nheads_k=2, attn_bias="heads", dropout_p=0.17)


def _seed(case):
    return zlib.crc32(str(case).encode())


def _assert_ok(result):
    assert result.ok, f"{result.case}: {result.describe()}"


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("case", [PLAIN, CAUSAL, VARLEN, BIAS, ONE_KEY_BLOCK], ids=str)
def test_kernel_families(case):
    _assert_ok(_check.run_gpu_case(case, _seed(case)))


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("family", sorted(FORCED))
def test_forced_tile_table(family, monkeypatch):
    """The case runs on the forced family's tiles (its backward tile is the table's) and is correct."""
    from cupyflash import _plan
    monkeypatch.setattr(_plan, "_plans", {})
    monkeypatch.setenv("CUPYFLASH_TILES", family)
    case = FORCED[family]
    _assert_ok(_check.run_gpu_case(case, _seed(case) + len(family)))
    bwd_tiles = {kernel.tile for plan in _plan._plans.values() for kernel in plan.kernels if kernel.pass_ == "bwd"}
    assert bwd_tiles == {_config.Tile(_config.padded_headdim(case.headdim), *_config.TILES[_config.MMA_SYNC][family]["bwd"][
        _config.padded_headdim(case.headdim)])}


@pytest.mark.usefixtures("poisoned_allocations")
def test_backward_with_its_last_wave_split(monkeypatch):
    from cupyflash import _plan, _schedule
    case, resident = TAIL_SPLIT
    monkeypatch.setattr(_plan, "_plans", {})
    monkeypatch.setattr(_schedule, "resident_ctas", lambda kernel, device: resident)
    monkeypatch.setenv("CUPYFLASH_FAMILY", "mma_sync")  # the split is the mma.sync backward's (the wgmma one is H200's)
    _assert_ok(_check.run_gpu_case(case, _seed(case) + resident))
    bwd_grids = [plan.launches[1][1] for plan in _plan._plans.values() if _is_backward(plan)]
    assert len(bwd_grids) == 1 and bwd_grids[0][2] > case.batch  # z slices past the batch: the pieces


def test_torch_round_trip():
    """cupyflash.torch's drop-in on CUDA tensors, autograd's gradients (attn_bias's too) and the dropout
    seed drawn from torch's generator."""
    pytest.importorskip("torch")
    from torch_helpers import _run_gpu_case
    result, _ = _run_gpu_case(TORCH_CASE, seed=_seed(TORCH_CASE))
    _assert_ok(result)


def test_jax_round_trip():
    """cupyflash.jax's varlen function under jit on XLA's stream, with every option but attn_bias."""
    pytest.importorskip("jax")
    from jax_helpers import _run_gpu_case
    result, _ = _run_gpu_case(VARLEN, _seed(VARLEN) + 1, jit=True)
    _assert_ok(result)
