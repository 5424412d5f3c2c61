"""cupyflash.torch, the varlen drop-in functions on CPU tensors: against the float64 reference with each
option of the matrix (tests/option_cases.py), as dense attention per sequence, in their packed
forms, and their argument checks.
(The test_torch_*.py files are split by concern; test_torch_autograd.py lists them.)
"""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("torch_helpers")

import cupyflash.torch as cft  # noqa: E402
from cupyflash import reference  # noqa: E402
from torch_helpers import (LENGTHS, RESULT_NAMES, VARLEN_OPTIONS, _assert_matches, _causal_call,  # noqa: E402
                           _dropin, _make_options, _max_error, _numpy, _reference_options, _varlen_call,
                           _varlen_inputs)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", VARLEN_OPTIONS)
def test_cpu_varlen_matches_reference(name, causal):
    q, k, v, dout, cu_q, cu_k = _varlen_inputs(LENGTHS, 4, 2, 16, torch.float64, "cpu", seed=30)
    shape = (len(LENGTHS[0]), max(LENGTHS[0]), max(LENGTHS[1]), 4)
    options = _make_options(VARLEN_OPTIONS[name], shape, torch.float64, "cpu", seed=31)
    got, seed = _dropin(_varlen_call(cu_q, cu_k, LENGTHS, 0.3, causal), q, k, v, dout, options)
    args = [_numpy(x) for x in (q, k, v)]
    opts = _reference_options(options, seed)
    ref_out, ref_lse = reference.attention_forward_varlen(*args, cu_q.numpy(), cu_k.numpy(), 0.3, causal, **opts)
    ref_grads = reference.attention_backward_varlen(_numpy(dout), *args, cu_q.numpy(), cu_k.numpy(), 0.3, causal,
                                                    **opts)
    assert got[1].shape == (4, sum(LENGTHS[0]))  # lse is (nheads, total_q)
    _assert_matches(got, [ref_out, ref_lse, *ref_grads, None])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cpu_varlen_is_dense_attention_per_sequence(causal):
    """Each sequence of a varlen call is a batch-1 flash_attn_func call on its rows (ALiBi slopes of its
    batch row, masks aligned to its own corner); rows of sequences without keys get zeros."""
    q, k, v, dout, cu_q, cu_k = _varlen_inputs(LENGTHS, 4, 2, 16, torch.float64, "cpu", seed=32)
    options = _make_options(dict(window_size=(2, 1), softcap=1.5, alibi_slopes="batch"),
                            (len(LENGTHS[0]), 0, 0, 4), torch.float64, "cpu", seed=33)
    got, _ = _dropin(_varlen_call(cu_q, cu_k, LENGTHS, None, causal), q, k, v, dout, options)
    expected = [torch.zeros_like(got[0]), torch.full_like(got[1], -math.inf), *(torch.zeros_like(g) for g in got[2:5])]
    for b in range(len(LENGTHS[0])):
        rows_q, rows_k = slice(*cu_q[b:b + 2].tolist()), slice(*cu_k[b:b + 2].tolist())
        if rows_q.start == rows_q.stop or rows_k.start == rows_k.stop:
            continue
        dense_options = dict(options, alibi_slopes=options["alibi_slopes"][b:b + 1])
        dense, _ = _dropin(_causal_call(cft.flash_attn_func, None, causal), q[None, rows_q], k[None, rows_k],
                           v[None, rows_k], dout[None, rows_q], dense_options)
        expected[0][rows_q], expected[1][:, rows_q] = dense[0][0], dense[1][0]
        expected[2][rows_q], expected[3][rows_k], expected[4][rows_k] = (g[0] for g in dense[2:5])
    for name, x, r in zip(RESULT_NAMES, got, expected):
        assert torch.equal(torch.isneginf(x), torch.isneginf(r)), name
        finite = torch.isfinite(r)
        assert _max_error(x[finite], r[finite]) <= 1e-12 * (1 + r[finite].abs().max().item()), name


def test_cpu_varlen_packed_forms_match_separate_ones():
    lengths = ((3, 6, 1), (3, 6, 1))
    q, k, v, dout, cu, _ = _varlen_inputs(lengths, 4, 4, 16, torch.float64, "cpu", seed=34)
    options = dict(window_size=(2, 0), softcap=1.5, dropout_p=0.2)
    ref, _ = _dropin(_varlen_call(cu, cu, lengths, None, True), q, k, v, dout, options, torch_seed=5)

    qkv = torch.stack([q, k, v], dim=1).requires_grad_()
    torch.manual_seed(5)
    out = cft.flash_attn_varlen_qkvpacked_func(qkv, cu, 6, causal=True, **options)
    (out * dout).sum().backward()
    for x, r in zip([out, *qkv.grad.unbind(1)], ref[:1] + ref[2:5]):
        assert torch.equal(x, r)

    kv = torch.stack([k, v], dim=1).requires_grad_()
    qq = q.clone().requires_grad_()
    torch.manual_seed(5)
    out = cft.flash_attn_varlen_kvpacked_func(qq, kv, cu, cu, 6, 6, causal=True, **options)
    (out * dout).sum().backward()
    for x, r in zip([out, qq.grad, *kv.grad.unbind(1)], ref[:1] + ref[2:5]):
        assert torch.equal(x, r)


def test_varlen_refusals():
    q, k, v, _, cu_q, cu_k = _varlen_inputs(LENGTHS, 2, 2, 16, torch.float32, "cpu", seed=36)
    max_q, max_k = max(LENGTHS[0]), max(LENGTHS[1])
    with pytest.raises(ValueError, match="k_cache must be 4-D"):
        cft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, block_table=torch.zeros(4, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="block_table must be a torch.Tensor"):
        cft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, block_table=[[0]])
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32"):
        cft.flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, max_q, max_k)
    with pytest.raises(TypeError, match="cu_seqlens_k must be an int32 torch.Tensor"):
        cft.flash_attn_varlen_func(q, k, v, cu_q, cu_k.tolist(), max_q, max_k)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        cft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q - 1, max_k)
    with pytest.raises(ValueError, match="qkv must be 4-D"):
        cft.flash_attn_varlen_qkvpacked_func(q, cu_q, max_q)


def test_varlen_from_a_paged_cache_equals_the_packed_call_with_gradients_into_the_caches():
    """block_table: the keys and values of each sequence sit in shuffled pages of a paged cache; out
    and lse are the packed call's, and the caches' gradients are the packed k and v's, each at its
    page and row (zero in the pages no sequence uses)."""
    sides = ((3, 0, 6, 1), (20, 2, 37, 16))  # keys over several pages, in one, in exactly one
    q, k, v, dout, cu_q, cu_k = _varlen_inputs(sides, 4, 2, 16, torch.float64, "cpu", seed=37)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    lengths, page = sides[1], 16
    pages = -(-max(lengths) // page)
    blocks = len(lengths) * pages + 2
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(38))[:len(lengths) * pages]
    table = table.view(len(lengths), pages).int()
    k_cache, v_cache = (torch.randn(blocks, page, 2, 16, dtype=torch.float64) for _ in range(2))
    where = [(table[b, t // page].item(), t % page, int(cu_k[b]) + t) for b in range(len(lengths))
             for t in range(lengths[b])]
    for cache, packed in ((k_cache, k), (v_cache, v)):
        for block, row, i in where:
            cache[block, row] = packed[i].detach()
    k_cache.requires_grad_(), v_cache.requires_grad_()
    options = dict(causal=True, softcap=3.0)
    max_q, max_k = max(sides[0]), max(lengths)
    want = cft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=True, **options)
    (want[0] * dout).sum().backward()
    qp = q.detach().clone().requires_grad_()
    got = cft.flash_attn_varlen_func(qp, k_cache, v_cache, cu_q, cu_k, max_q, max_k, block_table=table,
                                     return_attn_probs=True, **options)
    (got[0] * dout).sum().backward()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(qp.grad, q.grad)
    for cache, packed in ((k_cache, k), (v_cache, v)):
        expected = torch.zeros_like(cache)
        for block, row, i in where:
            expected[block, row] = packed.grad[i]
        assert torch.equal(cache.grad, expected)


def test_varlen_from_a_paged_cache_compiles_whole_and_takes_new_lengths_and_tables():
    """The paged gather has no host read and no value-dependent size: torch.compile(fullgraph=True)
    traces it, and the compiled call gives the eager one's out for other lengths and block tables."""
    import numpy
    from reference_helpers import paged_varlen_case
    q, _, _, cu_q, cu_k, table, caches = (torch.from_numpy(numpy.asarray(x)) for x in
                                          paged_varlen_case(numpy.random.default_rng(39)))
    k_cache, v_cache = caches

    def attention(cu_k, table):
        return cft.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 5, 33, causal=True, block_table=table)
    compiled = torch.compile(attention, fullgraph=True)
    for lengths, order in (((20, 7, 33), [0, 1, 2]), ((33, 0, 1), [2, 0, 1])):
        cu = torch.tensor(numpy.cumsum((0,) + lengths), dtype=torch.int32)
        assert torch.equal(compiled(cu, table[order]), attention(cu, table[order]))


def test_paged_varlen_refusals_name_the_argument():
    import numpy
    from reference_helpers import paged_varlen_case, paged_varlen_refusals
    q, _, _, cu_q, cu_k, table, (k_cache, v_cache) = paged_varlen_case(numpy.random.default_rng(40))
    arguments = {name: torch.from_numpy(x) for name, x in dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_q,
                                                                cu_seqlens_k=cu_k, block_table=table).items()}
    call = lambda **changes: cft.flash_attn_varlen_func(max_seqlen_q=5, max_seqlen_k=33,  # noqa: E731
                                                        **dict(arguments, **changes))
    for changes, error, message in paged_varlen_refusals(table, k_cache, v_cache):
        with pytest.raises(error, match=message):
            call(**{name: torch.from_numpy(x) for name, x in changes.items()})
    with pytest.raises(ValueError, match="max_seqlen_k must be an int >= 0"):
        cft.flash_attn_varlen_func(max_seqlen_q=5, max_seqlen_k=-1, **arguments)
    with pytest.raises(ValueError, match="block_table is on meta but k .* is on cpu"):
        call(block_table=arguments["block_table"].to("meta"))
