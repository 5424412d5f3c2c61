"""Greedy generation by a small Llama-style decoder on the GPU (tests/test_torch_model.py's Decoder,
random weights, bf16): tokens per second of the decode steps with cupyflash's KV cache (dense and
paged; eager, and one decode step captured in a CUDA graph and replayed) against SDPA decoding over
a dense torch cache, and whether each generates SDPA's tokens.

    python bench/generate.py [--batches 1 32] [--tokens 64] [--out bench/results]

Writes generate.md. The prompt (16 tokens) is one chunk through each path's cache; the decode steps
are timed between CUDA events, after a warm-up generation.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_torch_model import Decoder  # noqa: E402

import cupyflash.torch as cft  # noqa: E402

CONFIG = dict(vocab=1024, hidden=1024, layers=4, heads=16, kv_heads=4, head_dim=64, ffn=2816, seqlen=256)
PROMPT, CAPACITY, PAGE = 16, 256, 16


class Caches:
    """Per layer a dense (batch, capacity, kv_heads, head_dim) cache, or pages in a shuffled block table."""

    def __init__(self, batch, paged, device):
        c = CONFIG
        generator = torch.Generator().manual_seed(1)
        if paged:
            pages = CAPACITY // PAGE
            self.table = torch.randperm(batch * pages, generator=generator).view(batch, pages).int().to(device)
            shape = (batch * pages, PAGE, c["kv_heads"], c["head_dim"])
        else:
            self.table, shape = None, (batch, CAPACITY, c["kv_heads"], c["head_dim"])
        self.kv = [(torch.zeros(shape, dtype=torch.bfloat16, device=device),
                    torch.zeros(shape, dtype=torch.bfloat16, device=device)) for _ in range(c["layers"])]


def cupyflash_step(model, tokens, caches, lengths, tables):
    """Logits of the last position; the layers' own rotary off (cos 1, sin 0: exact), the KV cache's on."""
    x = model.embed(tokens)
    s = tokens.shape[1]
    unturned = torch.ones_like(model.cos[:s]), torch.zeros_like(model.sin[:s])
    for layer, (k_cache, v_cache) in zip(model.layers, caches.kv):
        x = layer(x, *unturned, lambda q, k, v: cft.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, *tables, cache_seqlens=lengths, block_table=caches.table, causal=True,
            rotary_interleaved=False))
    return model.head(model.norm(x[:, -1]))


def sdpa_step(model, tokens, caches, position):
    """The same with SDPA over a torch cache (batch, kv_heads, capacity, head_dim), rotary by the model."""
    x = model.embed(tokens)
    s = tokens.shape[1]
    cos, sin = model.cos[position:position + s], model.sin[position:position + s]
    for layer, (k_cache, v_cache) in zip(model.layers, caches):
        def attention(q, k, v):
            k_cache[:, :, position:position + s] = k.transpose(1, 2)
            v_cache[:, :, position:position + s] = v.transpose(1, 2)
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k_cache[:, :, :position + s], v_cache[:, :, :position + s], is_causal=s > 1,
                enable_gqa=True).transpose(1, 2)
        x = layer(x, cos, sin, attention)
    return model.head(model.norm(x[:, -1]))


def generate_sdpa(model, prompt, steps):
    batch, c = prompt.shape[0], CONFIG
    caches = [(torch.zeros(batch, c["kv_heads"], CAPACITY, c["head_dim"], dtype=torch.bfloat16, device="cuda"),
               torch.zeros(batch, c["kv_heads"], CAPACITY, c["head_dim"], dtype=torch.bfloat16, device="cuda"))
              for _ in range(c["layers"])]
    current = sdpa_step(model, prompt, caches, 0).argmax(-1, keepdim=True)
    out = [current]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for step in range(steps - 1):
        current = sdpa_step(model, current, caches, PROMPT + step).argmax(-1, keepdim=True)
        out.append(current)
    end.record()
    end.synchronize()
    return torch.cat(out, 1), start.elapsed_time(end)


def generate_cupyflash(model, prompt, steps, paged, graphed, forced=None):
    """(tokens, ms of the decode steps); with `forced` (another generation's tokens) each step is fed
    forced's previous token instead of its own, so that each of its tokens is a prediction from the
    same context as forced's."""
    batch = prompt.shape[0]
    half = CONFIG["head_dim"] // 2
    tables = (model.cos[:, 0, :half].contiguous(), model.sin[:, 0, :half].contiguous())
    caches = Caches(batch, paged, "cuda")
    lengths = torch.zeros(batch, dtype=torch.int32, device="cuda")
    current = cupyflash_step(model, prompt, caches, lengths, tables).argmax(-1, keepdim=True)
    lengths += PROMPT
    out = [current]
    step = lambda: cupyflash_step(model, current, caches, lengths, tables).argmax(-1, keepdim=True)  # noqa: E731
    if graphed:  # one decode step captured; each replay reads `current` and `lengths` where they are
        static = current.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            current = static
            snapshot = [(k.clone(), v.clone()) for k, v in caches.kv]
            step()  # warm-up outside the capture (its cache writes are undone below)
            with torch.cuda.graph(graph, stream=side):
                captured = step()
        torch.cuda.current_stream().wait_stream(side)
        for (k, v), (k0, v0) in zip(caches.kv, snapshot):
            k.copy_(k0)
            v.copy_(v0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(steps - 1):
        if forced is not None:
            fed = forced[:, i:i + 1]
            if graphed:
                static.copy_(fed)
            else:
                current = fed
        if graphed:
            graph.replay()
            out.append(captured.clone())
            if forced is None:
                static.copy_(captured)
        else:
            current = step()
            out.append(current)
        lengths += 1
    end.record()
    end.synchronize()
    return torch.cat(out, 1), start.elapsed_time(end)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Decoder(CONFIG).to("cuda", torch.bfloat16)
    lines = ["# Greedy generation: decode tokens per second", "",
             f"{torch.cuda.get_device_name()}; model {CONFIG}, bf16, random weights; prompt {PROMPT} tokens, "
             f"{args.tokens} generated; tokens/s = batch x decode steps / their time (CUDA events, after a "
             "warm-up generation). 'same tokens' compares with SDPA's generation.", "",
             "The last column feeds each step SDPA's previous token (teacher forcing): the share of steps whose "
             "prediction from the same context equals SDPA's.", "",
             "| batch | path | tokens/s | ms per step | same tokens as SDPA | same next token, fed SDPA's |",
             "|---|---|---|---|---|---|"]
    with torch.no_grad():
        for batch in args.batches:
            prompt = torch.randint(0, CONFIG["vocab"], (batch, PROMPT), device="cuda",
                                   generator=torch.Generator("cuda").manual_seed(batch))
            generate_sdpa(model, prompt, args.tokens)  # warm-up: kernels, allocator
            want, ms = generate_sdpa(model, prompt, args.tokens)
            lines.append(f"| {batch} | SDPA (dense torch cache) | {batch * (args.tokens - 1) / (ms / 1e3):.0f} | "
                         f"{ms / (args.tokens - 1):.3f} | 1 | 1 |")
            for paged in (False, True):
                for graphed in (False, True):
                    name = f"cupyflash {'paged16' if paged else 'dense'}{', CUDA graph' if graphed else ''}"
                    generate_cupyflash(model, prompt, args.tokens, paged, graphed)  # warm-up: plans, kernels
                    tokens, ms = generate_cupyflash(model, prompt, args.tokens, paged, graphed)
                    fed, _ = generate_cupyflash(model, prompt, args.tokens, paged, graphed, forced=want)
                    same, same_fed = ((t == want).float().mean().item() for t in (tokens, fed))
                    lines.append(f"| {batch} | {name} | {batch * (args.tokens - 1) / (ms / 1e3):.0f} | "
                                 f"{ms / (args.tokens - 1):.3f} | {same:.4f} | {same_fed:.4f} |")
                    print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "generate.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
