"""cupyflash.torch in a model: a small Llama-style decoder, and transformers' LlamaForCausalLM with
cupyflash plugged in through its AttentionInterface, trained end to end against SDPA (CPU, and
CUDA marked `gpu`).
(The test_torch_*.py files are split by concern; test_torch_autograd.py lists them.)
"""

import contextlib
import copy
import json
import os

import numpy
import pytest

torch = pytest.importorskip("torch")
pytest.register_assert_rewrite("torch_helpers")

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cupyflash.torch as cft  # noqa: E402
from torch_helpers import DEVICES, cupyflash_attention  # noqa: E402

# --------------------------------------------------------------------------------------------
# A small Llama-style decoder trained end to end


LLAMA = dict(vocab=64, hidden=256, layers=2, heads=8, kv_heads=2, head_dim=32, ffn=688, seqlen=128, batch=8,
             steps=20, lr=1e-3)
LLAMA_CPU = dict(LLAMA, seqlen=64, batch=2)  # the NumPy reference is slow: fewer tokens on the CPU


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x, cos, sin):
    """Rotary embedding on (batch, seqlen, heads, headdim), halves rotated as in Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class DecoderLayer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.attn_norm, self.mlp_norm = RMSNorm(c["hidden"]), RMSNorm(c["hidden"])
        self.qkv = torch.nn.Linear(c["hidden"], (c["heads"] + 2 * c["kv_heads"]) * c["head_dim"], bias=False)
        self.o = torch.nn.Linear(c["heads"] * c["head_dim"], c["hidden"], bias=False)
        self.gate_up = torch.nn.Linear(c["hidden"], 2 * c["ffn"], bias=False)
        self.down = torch.nn.Linear(c["ffn"], c["hidden"], bias=False)

    def forward(self, x, cos, sin, attention):
        b, s, _ = x.shape
        h, hk, d = self.c["heads"], self.c["kv_heads"], self.c["head_dim"]
        q, k, v = self.qkv(self.attn_norm(x)).split([h * d, hk * d, hk * d], dim=-1)
        # v stays a strided view of the qkv projection: the kernels read it in place.
        q, k, v = rotate(q.view(b, s, h, d), cos, sin), rotate(k.view(b, s, hk, d), cos, sin), v.view(b, s, hk, d)
        x = x + self.o(attention(q, k, v).reshape(b, s, h * d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Decoder(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = torch.nn.Embedding(c["vocab"], c["hidden"])
        self.layers = torch.nn.ModuleList(DecoderLayer(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"])
        self.head = torch.nn.Linear(c["hidden"], c["vocab"], bias=False)
        inv_freq = 10000.0 ** (-torch.arange(0, c["head_dim"], 2, dtype=torch.float64) / c["head_dim"])
        angles = torch.outer(torch.arange(c["seqlen"], dtype=torch.float64), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos().float()[:, None, :], persistent=False)
        self.register_buffer("sin", angles.sin().float()[:, None, :], persistent=False)

    def loss(self, tokens, attention):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, attention)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def sdpa_attention(q, k, v):
    """PyTorch's SDPA; kv heads repeated for GQA."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


# Each run: (attention, SDPA backends allowed, compute dtype). The last three are PyTorch's own: its
# default backend and its math backend in bfloat16, and float32 as the truth.
RUNS = {"cupyflash_bf16": ("cupyflash", None, torch.bfloat16),
        "sdpa_bf16": ("sdpa", None, torch.bfloat16),
        "sdpa_math_bf16": ("sdpa", SDPBackend.MATH, torch.bfloat16),
        "sdpa_fp32": ("sdpa", None, torch.float32)}


def _batch(c, device, seed):
    """One fixed batch of tokens, trained on at every step. With a 64-token vocabulary a token says
    little about the next one, so memorising the batch needs attention over the context: the loss
    falls fast, and through attention's gradients (with dq zeroed it lags by tenths)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, c["vocab"], (c["batch"], c["seqlen"]), generator=gen).to(device)


def train(model, step_loss, attention, backend, compute_dtype, tokens, c):
    """AdamW on a copy of `model` with float32 master weights and `compute_dtype` autocast. Returns
    the loss at each step and the float32 gradients of the first step."""
    model = copy.deepcopy(model)
    loss_of = step_loss(model, attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=c["lr"], weight_decay=0.0)
    losses, first_grads = [], None
    with sdpa_kernel(backend) if backend else contextlib.nullcontext():
        for _ in range(c["steps"]):
            with torch.autocast(tokens.device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
                loss = loss_of(tokens)
            loss.backward()
            if first_grads is None:
                first_grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses, first_grads


def compare_runs(runs):
    """The checks, in the project's rule (cupyflash/_check.py) applied to a whole model, with PyTorch's
    own bfloat16 attention as "the same computation in low precision" and float32 as the truth.

    Gradients of the first step, per parameter: cupyflash's distance from float32 is at most 3x the
    larger of the two SDPA bfloat16 runs' distances. Loss curves: bfloat16 arithmetic moves a
    curve by `spread`, the larger of max|sdpa_bf16 - fp32| and max|sdpa_math_bf16 - sdpa_bf16|
    over the steps; cupyflash's curve stays within 3x that of sdpa_bf16's. (Tried on the CPU
    configuration: dq scaled by 0.9 or dv by 1.05 fails the gradient checks, dq = 0 fails both.)
    Returns a list of (what, value, bound)."""
    losses = {n: numpy.array(r[0]) for n, r in runs.items()}
    grads = {n: r[1] for n, r in runs.items()}
    checks = []
    for name, truth in grads["sdpa_fp32"].items():
        error = {n: (grads[n][name] - truth).norm().item() for n in RUNS if n != "sdpa_fp32"}
        checks.append((f"grad {name}", error["cupyflash_bf16"],
                       3 * max(error["sdpa_bf16"], error["sdpa_math_bf16"])))
    spread = max(numpy.abs(losses["sdpa_bf16"] - losses["sdpa_fp32"]).max(),
                 numpy.abs(losses["sdpa_math_bf16"] - losses["sdpa_bf16"]).max())
    checks.append(("loss curve", numpy.abs(losses["cupyflash_bf16"] - losses["sdpa_bf16"]).max(), 3 * spread))
    return checks


def _report(test, runs, checks):
    """Prints the loss curves and the checks (pytest -s shows them); with CUPYFLASH_LOSS_CURVES set,
    appends them to that file as a JSON line."""
    names = list(runs)
    lines = [f"{test}\nstep " + " ".join(f"{n:>15}" for n in names)]
    lines += [f"{step:4d} " + " ".join(f"{runs[n][0][step]:15.6f}" for n in names) for step in range(len(runs[names[0]][0]))]
    lines += [f"{what}: {value:.4g} (bound {bound:.4g}){'' if value <= bound else ' FAIL'}" for what, value, bound in checks]
    print("\n" + "\n".join(lines))
    path = os.environ.get("CUPYFLASH_LOSS_CURVES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "losses": {n: runs[n][0] for n in names},
                                "checks": [[w, float(v), float(b)] for w, v, b in checks]}) + "\n")


@pytest.fixture
def one_torch_thread():
    """On the CPU, torch's busy-waiting threads and the reference's BLAS threads fight over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_and_compare(test, model, step_loss, c, device):
    tokens = _batch(c, device, seed=1)
    runs = {name: train(model, step_loss, attention, backend, dtype, tokens, c)
            for name, (attention, backend, dtype) in RUNS.items()}
    checks = compare_runs(runs)
    _report(test, runs, checks)
    first, last = runs["sdpa_bf16"][0][0], runs["sdpa_bf16"][0][-1]
    assert last < first / 2, "the model does not train, so the comparison would mean little"
    failed = [f"{what}: {value:.4g} > {bound:.4g}" for what, value, bound in checks if not value <= bound]
    assert not failed, failed


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("device", DEVICES)
def test_llama_training_matches_sdpa(device, request):
    """20 AdamW steps of a 2-layer Llama-style decoder (GQA 8/2 heads of 32, causal, rotary, SwiGLU,
    RMSNorm; float32 weights, bfloat16 autocast) with cupyflash and with SDPA, same start and data."""
    c = LLAMA_CPU if device == "cpu" else LLAMA
    torch.manual_seed(0)
    model = Decoder(c).to(device)
    attentions = {"cupyflash": cupyflash_attention, "sdpa": sdpa_attention}
    step_loss = lambda m, attention: lambda tokens: m.loss(tokens, attentions[attention])  # noqa: E731
    _train_and_compare(request.node.name, model, step_loss, c, device)


def _check_causal_only(mask, seqlen_q, seqlen_k):
    """cupyflash gets causal=True and no mask: fail loudly if the model meant anything else."""
    if mask is None:
        return
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=mask.device).tril(seqlen_k - seqlen_q)
    visible = mask if mask.dtype == torch.bool else mask == 0
    assert bool((visible == allowed).all()), "the model asked for a mask other than the causal one"


def hf_cupyflash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract: (batch, heads, seqlen, headdim) in, (batch, seqlen,
    heads, headdim) out, and the attention weights (none here)."""
    _check_causal_only(attention_mask, query.shape[2], key.shape[2])
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as transformers' flash_attn path does: rotary left q, k in float32
        query, key, value = (x.to(torch.get_autocast_dtype(device)) for x in (query, key, value))
    out = cft.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                              dropout_p=dropout, softmax_scale=scaling, causal=True)
    return out, None


HF_NAMES = {"cupyflash": "cupy_attention", "sdpa": "sdpa"}  # a name with "flash" in it means flash_attn to transformers


def _hf_step_loss(model, attention):
    name = HF_NAMES[attention]
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
    return lambda tokens: model(input_ids=tokens, labels=tokens).loss


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("device", DEVICES)
def test_transformers_llama_training_matches_sdpa(device, request):
    transformers = pytest.importorskip("transformers", minversion="4.48")  # AttentionInterface
    transformers.AttentionInterface.register(HF_NAMES["cupyflash"], hf_cupyflash_attention)
    c = LLAMA_CPU if device == "cpu" else LLAMA
    config = transformers.LlamaConfig(
        vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["ffn"], num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
        max_position_embeddings=c["seqlen"], attention_dropout=0.0, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    _train_and_compare(request.node.name, model, _hf_step_loss, c, device)
