"""cupyflash.torch.ring_flash_attn_func (context parallelism) on the CPU: the ring's schedule against the
causal mask it stands for, and 2 and 4 gloo processes whose sharded forward and gradients, gathered,
equal single-process attention over the whole sequence (float64, the NumPy path), causal zigzag and
contiguous layouts, GQA and softcap; the bad-input errors.
(The test_torch_*.py files are split by concern; test_torch_autograd.py lists them.)
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import cupyflash.torch as cft  # noqa: E402
from cupyflash._ring import ring_steps  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_ring_steps_cover_the_mask_once(world, layout, causal):
    """Every (query, key) pair the mask shows is computed by exactly one piece of one step, and no
    other; zigzag steps under a causal mask all cost the same."""
    local = 12 if layout == "zigzag" else 6
    total = world * local
    chunk = local // 2

    def positions(rank):  # global positions of a rank's slice, in its local order
        if layout == "contiguous":
            return np.arange(rank * local, (rank + 1) * local)
        return np.concatenate([np.arange(rank * chunk, (rank + 1) * chunk),
                               np.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)])
    seen = np.zeros((total, total), int)
    for rank in range(world):
        costs = []
        for step in range(world):
            source = (rank - step) % world
            cost = 0
            for piece in ring_steps(rank, source, world, causal, layout, local):
                rows = positions(rank)[piece.q0:piece.q1]
                keys = positions(source)[piece.k0:piece.k1]
                visible = np.ones((len(rows), len(keys)), bool)
                if piece.causal:  # bottom-right aligned in the local order
                    visible = np.tril(visible, len(keys) - len(rows))
                seen[np.ix_(rows, keys)] += visible
                cost += visible.sum()
            costs.append(cost)
        if causal and layout == "zigzag":
            assert max(costs) - min(costs) <= chunk, costs  # the diagonal step's half-chunk surplus at most
    want = np.tril(np.ones((total, total), int)) if causal else np.ones((total, total), int)
    np.testing.assert_array_equal(seen, want)


def _worker(rank, world, path, case):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        generator = torch.Generator().manual_seed(7)
        draw = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
        batch, seqlen, nheads, nheads_k, headdim = 2, case["seqlen"], 4, case["nheads_k"], 24
        q, k, v = draw(batch, seqlen, nheads, headdim), draw(batch, seqlen, nheads_k, headdim), \
            draw(batch, seqlen, nheads_k, headdim)
        weight = draw(batch, seqlen, nheads, headdim)
        layout, options = case["layout"], dict(causal=case["causal"], softcap=case["softcap"])
        local = [cft.shard_sequence(x, layout=layout).requires_grad_() for x in (q, k, v)]
        out = cft.ring_flash_attn_func(*local, layout=layout, **options)
        (out * cft.shard_sequence(weight, layout=layout)).sum().backward()
        gathered = [cft.unshard_sequence(x, layout=layout) for x in (out.detach(), *(t.grad for t in local))]
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        want = cft.flash_attn_func(*full, **options)
        (want * weight).sum().backward()
        for name, got, expected in zip(("out", "dq", "dk", "dv"), gathered,
                                       (want.detach(), *(t.grad for t in full))):
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10, msg=lambda m: f"rank {rank} {name}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, case", [
    (2, dict(seqlen=48, layout="zigzag", causal=True, nheads_k=2, softcap=0.0)),
    (2, dict(seqlen=40, layout="contiguous", causal=False, nheads_k=4, softcap=3.0)),
    (4, dict(seqlen=64, layout="zigzag", causal=True, nheads_k=1, softcap=2.5)),
    (4, dict(seqlen=36, layout="contiguous", causal=True, nheads_k=2, softcap=0.0)),
], ids=["2-zigzag-causal-gqa", "2-contiguous-softcap", "4-zigzag-causal-mqa-softcap", "4-contiguous-causal"])
def test_the_ring_over_gloo_gives_single_process_attention_and_gradients(world, case, tmp_path):
    torch.multiprocessing.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), case), nprocs=world)


def test_bad_arguments_name_themselves():
    q = torch.zeros(1, 8, 2, 16)
    with pytest.raises(ValueError, match="layout must be one of"):
        cft.ring_flash_attn_func(q, q, q, layout="striped")
    with pytest.raises(NotImplementedError, match="does not take window_size yet"):
        cft.ring_flash_attn_func(q, q, q, window_size=(4, 0))
    with pytest.raises(NotImplementedError, match="does not take alibi_slopes yet"):
        cft.ring_flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="must hold the same slice"):
        cft.ring_flash_attn_func(q, q[:, :4], q[:, :4])
    with pytest.raises(ValueError, match="length must be even"):
        cft.ring_flash_attn_func(q[:, :7], q[:, :7], q[:, :7])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        cft.ring_flash_attn_func(q.numpy(), q, q)
