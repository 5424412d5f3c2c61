"""CPU tests of the reference's masks: causal and window visibility (aligned bottom-right), windows at
their limits, and the key/query block ranges the tiled functions (and the kernels) walk.
(The reference's test files by concern: see test_reference.py.)
"""

import numpy as np
import pytest

from cupyflash import reference as ref

pytest.register_assert_rewrite("reference_helpers")
from reference_helpers import random_inputs  # noqa: E402


def test_visible_is_aligned_bottom_right():
    expected = np.array([[1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(ref.visible(2, 5, True), expected)
    expected = np.array([[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]], dtype=bool)
    np.testing.assert_array_equal(ref.visible(5, 2, True), expected)
    assert ref.visible(3, 4, False).all() and ref.visible(3, 4, False).shape == (3, 4)
    # A tile is the corresponding piece of the full matrix.
    full = ref.visible(37, 29, True)
    np.testing.assert_array_equal(ref.visible(37, 29, True, slice(16, 32), slice(8, 16)), full[16:32, 8:16])


def test_visible_window_hand_checked_cases():
    # seqlen_q = seqlen_k = 6, window (2, 0): row i sees keys i - 2 .. i.
    mask = ref.visible(6, 6, False, window_size=(2, 0))
    assert np.flatnonzero(mask[3]).tolist() == [1, 2, 3]
    assert np.flatnonzero(mask[0]).tolist() == [0]
    assert np.flatnonzero(mask[5]).tolist() == [3, 4, 5]
    # seqlen_q = 3, seqlen_k = 5, window (1, 1): row i's diagonal is key i + 2.
    expected = np.array([[0, 1, 1, 1, 0],
                         [0, 0, 1, 1, 1],
                         [0, 0, 0, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(ref.visible(3, 5, False, window_size=(1, 1)), expected)
    # seqlen_q = 5, seqlen_k = 3, window (0, 1): row i sees keys i - 2 .. i - 1.
    expected = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 1], [0, 0, 1]], dtype=bool)
    np.testing.assert_array_equal(ref.visible(5, 3, False, window_size=(0, 1)), expected)
    # Causal intersects: right is cut to 0, left stays.
    np.testing.assert_array_equal(ref.visible(3, 5, True, window_size=(1, 1)),
                                  ref.visible(3, 5, False, window_size=(1, 0)))
    # A tile is the corresponding piece of the full matrix.
    full = ref.visible(37, 29, True, window_size=(5, 3))
    np.testing.assert_array_equal(ref.visible(37, 29, True, slice(16, 32), slice(8, 16), window_size=(5, 3)),
                                  full[16:32, 8:16])


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(6, 6), (4, 9), (9, 4)])
def test_window_limits_equal_causal_and_no_mask(seqlen_q, seqlen_k):
    np.testing.assert_array_equal(ref.visible(seqlen_q, seqlen_k, False, window_size=(-1, 0)),
                                  ref.visible(seqlen_q, seqlen_k, True))
    assert ref.visible(seqlen_q, seqlen_k, False, window_size=(-1, -1)).all()
    q, k, v, dout = random_inputs(seqlen_q * 7 + seqlen_k, 2, seqlen_q, seqlen_k, 2, 1, 8)
    # (window, causal with the window, causal of the plain attention it must equal)
    for window, with_causal, causal in (((-1, 0), False, True), ((-1, -1), False, False), ((-1, 5), True, True)):
        out_w, lse_w = ref.attention_forward(q, k, v, window_size=window, causal=with_causal)
        out_c, lse_c = ref.attention_forward(q, k, v, causal=causal)
        np.testing.assert_array_equal(out_w, out_c)
        np.testing.assert_array_equal(lse_w, lse_c)
        for g_w, g_c in zip(ref.attention_backward(dout, q, k, v, window_size=window, causal=with_causal),
                            ref.attention_backward(dout, q, k, v, causal=causal)):
            np.testing.assert_array_equal(g_w, g_c)


def test_window_rows_match_attention_over_their_keys():
    # seqlen_q = seqlen_k = 6, window (2, 0): row 3 is plain attention over keys 1..3.
    q, k, v, _ = random_inputs(521, 1, 6, 6, 2, 2, 4)
    out, lse = ref.attention_forward(q, k, v, window_size=(2, 0))
    row3, lse3 = ref.attention_forward(q[:, 3:4], k[:, 1:4], v[:, 1:4])
    np.testing.assert_allclose(out[:, 3:4], row3, rtol=1e-14)
    np.testing.assert_allclose(lse[..., 3], lse3[..., 0], rtol=1e-14)
    # seqlen_q = 3, seqlen_k = 5, window (1, 1): row 0 is attention over keys 1..3.
    q, k, v, _ = random_inputs(522, 1, 3, 5, 2, 1, 4)
    out, lse = ref.attention_forward(q, k, v, window_size=(1, 1))
    row0, lse0 = ref.attention_forward(q[:, :1], k[:, 1:4], v[:, 1:4])
    np.testing.assert_allclose(out[:, :1], row0, rtol=1e-14)
    np.testing.assert_allclose(lse[..., 0], lse0[..., 0], rtol=1e-14)


def test_block_ranges_hand_checked():
    # seqlen 64, window (8, 0), blocks of 16: rows 32..47 see keys 24..47, blocks 1 and 2.
    assert ref.key_block_range(slice(32, 48), 64, 64, 16, window_size=(8, 0)) == range(1, 3)
    assert ref.key_block_range(slice(0, 16), 64, 64, 16, window_size=(8, 0)) == range(0, 1)
    assert ref.key_block_range(slice(0, 16), 64, 64, 16, causal=True) == range(0, 1)
    assert ref.key_block_range(slice(0, 16), 64, 64, 16) == range(0, 4)
    # Keys 16..31 are seen by rows 16..39, query blocks 1 and 2.
    assert ref.query_block_range(slice(16, 32), 64, 64, 16, window_size=(8, 0)) == range(1, 3)
    # seqlen_q = 40 > seqlen_k = 8, causal: rows 0..31 see nothing.
    assert len(ref.key_block_range(slice(0, 16), 40, 8, 4, causal=True)) == 0
    assert ref.query_block_range(slice(0, 4), 40, 8, 16, causal=True) == range(2, 3)


@pytest.mark.parametrize("seqlen_q, seqlen_k, window, causal, block_m, block_n", [
    (64, 64, (8, 0), False, 16, 16),
    (61, 47, (5, 3), False, 8, 16),
    (29, 53, (-1, 2), True, 16, 8),
    (53, 29, (3, -1), False, 8, 8),
    (40, 8, (-1, -1), True, 16, 4),
])
def test_block_ranges_are_exact(seqlen_q, seqlen_k, window, causal, block_m, block_n):
    mask = ref.visible(seqlen_q, seqlen_k, causal, window_size=window)
    for m, rows in enumerate(ref.tiled._blocks(seqlen_q, block_m)):
        expected = [n for n, cols in enumerate(ref.tiled._blocks(seqlen_k, block_n)) if mask[rows, cols].any()]
        got = ref.key_block_range(rows, seqlen_q, seqlen_k, block_n, causal, window_size=window)
        assert list(got) == expected
    for n, cols in enumerate(ref.tiled._blocks(seqlen_k, block_n)):
        expected = [m for m, rows in enumerate(ref.tiled._blocks(seqlen_q, block_m)) if mask[rows, cols].any()]
        got = ref.query_block_range(cols, seqlen_q, seqlen_k, block_m, causal, window_size=window)
        assert list(got) == expected


def test_tiled_functions_skip_tiles_outside_the_window(monkeypatch):
    seqlen, block = 64, 16
    q, k, v, dout = random_inputs(531, 1, seqlen, seqlen, 2, 2, 8)
    visited = []
    monkeypatch.setattr(ref.tiled, "tile_hook", lambda pass_name, rows, cols: visited.append(
        (pass_name, rows.start // block, cols.start // block)))

    def tiles(pass_name, **opts):
        visited.clear()
        out, lse = ref.attention_forward_tiled(q, k, v, block_m=block, block_n=block, **opts)
        ref.attention_backward_tiled(dout, q, k, v, out, lse, block_m=block, block_n=block, **opts)
        return sorted((m, n) for name, m, n in visited if name == pass_name)

    assert len(tiles("forward")) == len(tiles("backward")) == 16
    assert len(tiles("forward", causal=True)) == 10
    # Window (8, 0): query block m sees key blocks m - 1 and m only.
    expected = [(0, 0)] + [(m, n) for m in range(1, 4) for n in (m - 1, m)]
    assert tiles("forward", window_size=(8, 0)) == tiles("backward", window_size=(8, 0)) == expected
    # Window (0, 0) is the diagonal alone: one tile per query block.
    assert tiles("forward", window_size=(0, 0)) == [(m, m) for m in range(4)]
