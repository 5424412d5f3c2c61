"""cupyflash.torch.ring_flash_attn_func (context parallelism) on the CPU: the ring's schedule against the
mask it stands for (causal, windows), and 2 and 4 gloo processes whose sharded forward and gradients,
gathered, equal single-process attention over the whole sequence (float64, the NumPy path), causal
zigzag and contiguous layouts, GQA, softcap and windows; the bad-input errors.
(The test_torch_*.py files are split by concern; test_torch_autograd.py lists them.)
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import cupyflash.torch as cft  # noqa: E402
from cupyflash import reference  # noqa: E402
from cupyflash._ring import ring_steps, window_piece  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal, window_size", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, -1)),
                                                 (False, (4, 7)), (False, (-1, 2)), (False, (0, 0))])
def test_the_ring_steps_cover_the_mask_once(world, layout, causal, window_size):
    """Every (query, key) pair the mask shows is computed by exactly one piece of one step, and no
    other; zigzag steps under a causal mask alone all cost the same."""
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
            for piece in ring_steps(rank, source, world, causal, layout, local, window_size):
                rows = positions(rank)[piece.q0:piece.q1]
                keys = positions(source)[piece.k0:piece.k1]
                # bottom-right aligned on the piece, in the local order
                visible = reference.visible(len(rows), len(keys), piece.causal, window_size=piece.window_size)
                seen[np.ix_(rows, keys)] += visible
                cost += visible.sum()
            costs.append(cost)
        if causal and layout == "zigzag" and window_size == (-1, -1):
            assert max(costs) - min(costs) <= chunk, costs  # the diagonal step's half-chunk surplus at most
    want = reference.visible(total, total, causal, window_size=window_size).astype(int)
    np.testing.assert_array_equal(seen, want)


def test_a_window_piece_is_the_window_on_the_rows_and_keys_it_keeps():
    """window_piece against the global window, element by element, over many ranges and windows:
    what it trims sees nothing, and flash_attn_func's window on what it keeps is the global one."""
    rng = np.random.default_rng(3)
    for _ in range(3000):
        qa, ka = rng.integers(0, 40, 2)
        qb, kb = qa + rng.integers(1, 20), ka + rng.integers(1, 20)
        left, right = rng.choice([-1, 0, 1, 3, 7, 15, 30]), rng.choice([-1, 0, 1, 4, 9, 25])
        p, j = np.arange(qa, qb)[:, None], np.arange(ka, kb)[None, :]
        want = ((left < 0) | (j >= p - left)) & ((right < 0) | (j <= p + right))
        got = np.zeros_like(want)
        piece = window_piece(qa, qb, ka, kb, left, right)
        if piece is not None:
            a, b, c, d, window = piece
            assert qa <= a < b <= qb and ka <= c < d <= kb and min(window) >= -1, piece
            got[a - qa:b - qa, c - ka:d - ka] = reference.visible(b - a, d - c, False, window_size=window)
        np.testing.assert_array_equal(got, want, err_msg=f"{(qa, qb, ka, kb, left, right)} -> {piece}")


def _worker(rank, world, path, case):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        generator = torch.Generator().manual_seed(7)
        draw = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
        batch, seqlen, nheads, nheads_k, headdim = 2, case["seqlen"], 4, case["nheads_k"], 24
        q, k, v = draw(batch, seqlen, nheads, headdim), draw(batch, seqlen, nheads_k, headdim), \
            draw(batch, seqlen, nheads_k, headdim)
        weight = draw(batch, seqlen, nheads, headdim)
        layout = case["layout"]
        options = dict(causal=case["causal"], softcap=case["softcap"], window_size=case.get("window_size", (-1, -1)))
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
    (2, dict(seqlen=48, layout="zigzag", causal=True, nheads_k=2, softcap=0.0, window_size=(9, -1))),
    (4, dict(seqlen=64, layout="zigzag", causal=False, nheads_k=4, softcap=1.5, window_size=(5, 11))),
    (4, dict(seqlen=36, layout="contiguous", causal=False, nheads_k=1, softcap=0.0, window_size=(-1, 3))),
], ids=["2-zigzag-causal-gqa", "2-contiguous-softcap", "4-zigzag-causal-mqa-softcap", "4-contiguous-causal",
        "2-zigzag-causal-window", "4-zigzag-window-softcap", "4-contiguous-right-window-mqa"])
def test_the_ring_over_gloo_gives_single_process_attention_and_gradients(world, case, tmp_path):
    torch.multiprocessing.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), case), nprocs=world)


def test_bad_arguments_name_themselves():
    q = torch.zeros(1, 8, 2, 16)
    with pytest.raises(ValueError, match="layout must be one of"):
        cft.ring_flash_attn_func(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="window_size entries must be >= -1"):
        cft.ring_flash_attn_func(q, q, q, window_size=(4, -2))
    with pytest.raises(NotImplementedError, match="does not take alibi_slopes yet"):
        cft.ring_flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="must hold the same slice"):
        cft.ring_flash_attn_func(q, q[:, :4], q[:, :4])
    with pytest.raises(ValueError, match="length must be even"):
        cft.ring_flash_attn_func(q[:, :7], q[:, :7], q[:, :7])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        cft.ring_flash_attn_func(q.numpy(), q, q)
