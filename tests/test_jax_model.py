"""cupyflash.jax in a model: a small transformer trained under jit with cupyflash.jax and with
jax.nn.dot_product_attention, on the CPU in float32 and (marked `gpu`) in bfloat16.
(The test_jax_*.py files are split by concern; test_jax_grad.py lists them.)
"""

import json
import os

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
pytest.register_assert_rewrite("jax_helpers")

from cupyflash.jax import flash_attn  # noqa: E402
from jax_helpers import _gpu, on_cpu  # noqa: E402, F401


VOCAB, DIM, HEADS, KV_HEADS, HEADDIM, LAYERS, SEQLEN, BATCH, STEPS = 32, 64, 4, 2, 16, 2, 48, 32, 20


def _init_model(key):
    keys = iter(jax.random.split(key, 3 + 6 * LAYERS))

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) * n_in ** -0.5

    params = {"embed": jax.random.normal(next(keys), (VOCAB, DIM), jnp.float32),
              "pos": jax.random.normal(next(keys), (SEQLEN, DIM), jnp.float32), "unembed": dense(DIM, VOCAB),
              "layers": []}
    for _ in range(LAYERS):
        params["layers"].append({
            "wq": dense(DIM, HEADS * HEADDIM), "wk": dense(DIM, KV_HEADS * HEADDIM),
            "wv": dense(DIM, KV_HEADS * HEADDIM), "wo": dense(HEADS * HEADDIM, DIM),
            "w1": dense(DIM, 4 * DIM), "w2": dense(4 * DIM, DIM)})
    return params


def _rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _loss(params, tokens, attention):
    batch, seqlen = tokens.shape
    x = params["embed"][tokens] + params["pos"][:seqlen]
    for layer in params["layers"]:
        h = _rms_norm(x)
        q = (h @ layer["wq"]).reshape(batch, seqlen, HEADS, HEADDIM)
        k = (h @ layer["wk"]).reshape(batch, seqlen, KV_HEADS, HEADDIM)
        v = (h @ layer["wv"]).reshape(batch, seqlen, KV_HEADS, HEADDIM)
        x = x + attention(q, k, v).reshape(batch, seqlen, HEADS * HEADDIM) @ layer["wo"]
        x = x + jax.nn.gelu(_rms_norm(x) @ layer["w1"]) @ layer["w2"]
    logits = _rms_norm(x) @ params["unembed"]
    # Next-token loss; the sequences repeat with period 3, so attention must look 2 tokens back.
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def _train(attention, steps=STEPS, lr=1e-2):
    """Losses of `steps` Adam steps, each one jitted step from the same initial parameters and data."""
    params = _init_model(jax.random.PRNGKey(0))
    period = jax.random.randint(jax.random.PRNGKey(1), (steps, BATCH, 3), 0, VOCAB)
    data = jnp.tile(period, (1, 1, SEQLEN // 3))
    moments = jax.tree.map(lambda p: (jnp.zeros_like(p), jnp.zeros_like(p)), params)

    @jax.jit
    def step(params, moments, tokens, t):
        loss, grads = jax.value_and_grad(_loss)(params, tokens, attention)

        def adam(p, g, m):
            m1, m2 = 0.9 * m[0] + 0.1 * g, 0.999 * m[1] + 0.001 * g * g
            update = (m1 / (1 - 0.9 ** t)) / (jnp.sqrt(m2 / (1 - 0.999 ** t)) + 1e-8)
            return p - lr * update, (m1, m2)

        pairs = jax.tree.map(adam, params, grads, moments, is_leaf=lambda x: isinstance(x, tuple))
        new_params = jax.tree.map(lambda pair: pair[0], pairs, is_leaf=lambda x: isinstance(x, tuple))
        new_moments = jax.tree.map(lambda pair: pair[1], pairs, is_leaf=lambda x: isinstance(x, tuple))
        return new_params, new_moments, loss

    losses = []
    for t in range(steps):
        params, moments, loss = step(params, moments, data[t], t + 1)
        losses.append(float(loss))
    return losses


def _attention_with(kind, dtype):
    """Attention on q, k, v rounded to `dtype`, result back in float32, by cupyflash or jax.nn."""
    def attention(q, k, v):
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        if kind == "cupyflash":
            out = flash_attn(q, k, v, causal=True)
        elif dtype == jnp.float32:  # the yardstick: float32 products, not TF32, on any GPU
            with jax.default_matmul_precision("highest"):
                out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        else:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return out.astype(jnp.float32)
    return attention


def _report_curves(name, curves, tmp_path):
    text = json.dumps(curves, indent=1)
    print(f"\n{name} loss curves:\n" + "\n".join(f"  {k:>16}: " + " ".join(f"{x:.4f}" for x in c)
                                               for k, c in curves.items()))
    out_dir = os.environ.get("CUPYFLASH_TEST_OUT") or str(tmp_path)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}_losses.json"), "w") as f:
        f.write(text)


def test_cpu_training_matches_dot_product_attention(on_cpu, tmp_path):
    """Both in float32: attention results differ by float32 rounding only (see _assert_close), so the
    two curves may drift apart by a few float32 ulps of the loss per step (about 2.4e-7 at loss 4);
    20 Adam steps at lr 1e-2 keep that far below 1e-5 of the initial loss (seen: 4.8e-7). A wrong
    gradient shows at the first update, at the scale of the per-step progress (~0.1)."""
    ours = _train(_attention_with("cupyflash", jnp.float32))
    theirs = _train(_attention_with("xla", jnp.float32))
    _report_curves("jax_cpu_float32", {"cupyflash": ours, "jax.nn (xla)": theirs}, tmp_path)
    assert ours[-1] < 0.5 * ours[0], "the model did not learn: the test would not tell a broken gradient"
    difference = max(abs(a - b) for a, b in zip(ours, theirs))
    assert difference <= 1e-5 * theirs[0], f"loss curves differ by {difference:.3g}"


@pytest.mark.gpu
def test_gpu_training_matches_dot_product_attention(tmp_path):
    """Three curves from the same seed: cupyflash in bf16, jax.nn (XLA) in bf16, jax.nn in float32.
    Both bf16 runs see the same rounded q, k, v; the rule mirrors _check.py's: cupyflash's curve may
    be at most 2x farther from the float32 curve than jax.nn's bf16 curve is, plus one bf16 unit
    roundoff (2^-8) at the scale of the initial loss, for steps where both land near float32 by chance."""
    with jax.default_device(_gpu()):
        ours = _train(_attention_with("cupyflash", jnp.bfloat16))
        theirs = _train(_attention_with("xla", jnp.bfloat16))
        exact = _train(_attention_with("xla", jnp.float32))
    _report_curves("jax_gpu_bfloat16", {"cupyflash bf16": ours, "jax.nn bf16": theirs, "jax.nn float32": exact},
                   tmp_path)
    assert ours[-1] < 0.5 * ours[0], "the model did not learn"
    ours_off = max(abs(a - b) for a, b in zip(ours, exact))
    theirs_off = max(abs(a - b) for a, b in zip(theirs, exact))
    bound = 2 * theirs_off + 2.0 ** -8 * exact[0]
    assert ours_off <= bound, f"cupyflash is {ours_off:.3g} off the float32 curve, bound {bound:.3g}"
