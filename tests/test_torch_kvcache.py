"""cupyflash.torch.flash_attn_with_kvcache on CPU tensors (the NumPy path): the same results as the
core on NumPy copies, the caches written in place (bfloat16 too), opcheck of the custom op that
declares its writes, torch.compile keeping them, and greedy generation by a small Llama-style model
with the cache (dense and paged) giving the tokens of recomputing every step.
(The test_torch_*.py files are split by concern; test_torch_autograd.py lists them.)
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyflash  # noqa: E402
import cupyflash.torch as cft  # noqa: E402
from cupyflash._arrays import bfloat16_dtype  # noqa: E402


def _inputs(dtype, paged=False, seed=5):
    generator = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)  # noqa: E731
    batch, seqlen_q, nheads, nheads_k, headdim, capacity = 2, 3, 4, 2, 32, 48
    inputs = dict(q=draw(batch, seqlen_q, nheads, headdim), k=draw(batch, seqlen_q, nheads_k, headdim),
                  v=draw(batch, seqlen_q, nheads_k, headdim), cache_seqlens=torch.tensor([7, 40], dtype=torch.int32))
    angles = torch.rand(capacity + seqlen_q, 8, generator=generator, dtype=torch.float64) * 6.28
    inputs.update(rotary_cos=angles.cos().to(dtype), rotary_sin=angles.sin().to(dtype))
    if paged:
        inputs.update(k_cache=draw(7, 16, nheads_k, headdim), v_cache=draw(7, 16, nheads_k, headdim),
                      block_table=torch.tensor([[5, 0, 2], [1, 6, 3]], dtype=torch.int32))
    else:
        inputs.update(k_cache=draw(batch, capacity, nheads_k, headdim), v_cache=draw(batch, capacity, nheads_k, headdim))
    return inputs


def _numpy(t):
    return t.float().numpy().astype(bfloat16_dtype()) if t.dtype == torch.bfloat16 else t.numpy().copy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True])
def test_the_dropin_writes_the_caches_in_place_and_matches_the_core(dtype, paged):
    inputs = _inputs(dtype, paged)
    arrays = {name: _numpy(t) for name, t in inputs.items()}
    options = dict(causal=True, softcap=3.0, rotary_interleaved=False, window_size=(20, 0))
    want_out, want_lse = cupyflash.flash_attn_with_kvcache(**arrays, **options, return_softmax_lse=True)
    before = inputs["k_cache"].clone()
    out, lse = cft.flash_attn_with_kvcache(**inputs, **options, return_softmax_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    np.testing.assert_array_equal(_numpy(out), want_out)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    for name in ("k_cache", "v_cache"):
        np.testing.assert_array_equal(_numpy(inputs[name]), arrays[name])  # written in place, as the core did
    assert not torch.equal(inputs["k_cache"], before)
    plain = cft.flash_attn_with_kvcache(inputs["q"], inputs["k_cache"], inputs["v_cache"], cache_seqlens=10)
    assert plain.shape == inputs["q"].shape


def test_opcheck_of_the_kvcache_op():
    inputs = _inputs(torch.float32)
    args = [inputs[n] for n in ("q", "k_cache", "v_cache")] + [0.25, True]
    args += [inputs[n] for n in ("k", "v", "rotary_cos", "rotary_sin", "cache_seqlens")]
    torch.library.opcheck(torch.ops.cupyflash.flash_attn_with_kvcache.default, args, dict(window_left=5, softcap=2.0))


def test_torch_compile_keeps_the_cache_writes():
    def step(q, k_cache, v_cache, k, v, cache_seqlens):
        out = cft.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=True)
        return out * 2

    torch._dynamo.reset()
    inputs = _inputs(torch.float32)
    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens")
    eager = {n: inputs[n].clone() for n in names}
    compiled = {n: inputs[n].clone() for n in names}
    want = step(**eager)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(**compiled)
    torch.testing.assert_close(got, want)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(compiled[name], eager[name]) and not torch.equal(compiled[name], inputs[name])


def test_bad_input_names_the_argument():
    inputs = _inputs(torch.float32)
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 array"):
        cft.flash_attn_with_kvcache(**dict(inputs, cache_seqlens=inputs["cache_seqlens"].long()))
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):
        cft.flash_attn_with_kvcache(**dict(inputs, cache_seqlens=-1))
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
        cft.flash_attn_with_kvcache(**inputs, num_splits=1.5)
    with pytest.raises(TypeError, match="k_cache must be a torch.Tensor"):
        cft.flash_attn_with_kvcache(**dict(inputs, k_cache=inputs["k_cache"].numpy()))
    with pytest.raises(ValueError, match="exceed the cache"):
        cft.flash_attn_with_kvcache(**dict(inputs, cache_seqlens=46))


# --------------------------------------------------------------------------------------------
# Greedy generation with the KV cache, against recomputing the whole sequence with SDPA.

SMALL_LLAMA = dict(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, seqlen=64)


def _generate_recomputing(model, prompt, steps):
    """Greedy tokens and the last logits of each step, each step running the whole sequence
    through SDPA with rotary applied by the model's own function."""
    from test_torch_model import sdpa_attention
    tokens, logits = prompt, []
    for _ in range(steps):
        s = tokens.shape[1]
        x = model.embed(tokens)
        for layer in model.layers:
            x = layer(x, model.cos[:s], model.sin[:s], sdpa_attention)
        logits.append(model.head(model.norm(x[:, -1])))
        tokens = torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], dim=1)
    return tokens, logits


def _generate_with_kvcache(model, prompt, steps, paged):
    """The same with cupyflash's KV cache: the prompt as one chunk, then a token a step, rotary
    (GPT-NeoX halves) applied by flash_attn_with_kvcache at the cache's positions."""
    c = model.layers[0].c
    batch, half = prompt.shape[0], c["head_dim"] // 2
    capacity, page = 48, 16
    cos, sin = model.cos[:, 0, :half], model.sin[:, 0, :half]
    generator = torch.Generator().manual_seed(3)
    if paged:  # each sequence's pages scattered among spare blocks
        pages = capacity // page
        table = torch.randperm(batch * pages + 4, generator=generator)[:batch * pages].view(batch, pages).int()
        shape = (batch * pages + 4, page, c["kv_heads"], c["head_dim"])
    else:
        table, shape = None, (batch, capacity, c["kv_heads"], c["head_dim"])
    caches = [(torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64))
              for _ in model.layers]
    lengths = torch.zeros(batch, dtype=torch.int32)
    tokens, current, logits = prompt, prompt, []
    for _ in range(steps):
        x = model.embed(current)
        # The layers' own rotary turned off (cos 1, sin 0: exact), flash_attn_with_kvcache rotates.
        unturned = torch.ones_like(model.cos[:current.shape[1]]), torch.zeros_like(model.sin[:current.shape[1]])
        for layer, (k_cache, v_cache) in zip(model.layers, caches):
            x = layer(x, *unturned, lambda q, k, v: cft.flash_attn_with_kvcache(
                q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=lengths, block_table=table, causal=True,
                rotary_interleaved=False))
        logits.append(model.head(model.norm(x[:, -1])))
        lengths = lengths + current.shape[1]
        current = logits[-1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, current], dim=1)
    return tokens, logits


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_greedy_generation_with_the_kvcache_matches_recomputation(batch, paged):
    """A small Llama-style model (test_torch_model's, float64) generates 16 tokens greedily after a
    5-token prompt: with the KV cache (dense or paged) the tokens are those of recomputing every
    step's whole sequence through SDPA, and the logits agree to float64 rounding."""
    from test_torch_model import Decoder
    torch.manual_seed(0)
    model = Decoder(SMALL_LLAMA).double()
    prompt = torch.randint(0, SMALL_LLAMA["vocab"], (batch, 5), generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        want_tokens, want_logits = _generate_recomputing(model, prompt, 16)
        tokens, logits = _generate_with_kvcache(model, prompt, 16, paged)
    assert torch.equal(tokens, want_tokens)
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
