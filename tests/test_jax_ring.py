"""cupyflash.jax.ring_flash_attn under jax.shard_map over 2 and 4 CPU devices: out and the gradients
equal cupyflash.jax.flash_attn over the whole sequence (float64, the NumPy path), zigzag and
contiguous layouts, causal or not, GQA, softcap and windows. Each case runs in a subprocess: XLA's number of
host devices is fixed when JAX starts.
(The test_jax_*.py files are split by concern; test_jax_grad.py lists them.)
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

_SCRIPT = r"""
import json, sys
import numpy as np
import jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
from jax.sharding import PartitionSpec as P
import cupyflash.jax as cfj

world, layout, causal, nheads_k, softcap, seqlen, window_size = json.loads(sys.argv[1])
mesh = jax.sharding.Mesh(np.array(jax.devices()[:world]), ("seq",))
rng = np.random.default_rng(7)
q = rng.standard_normal((2, seqlen, 4, 24))
k, v = (rng.standard_normal((2, seqlen, nheads_k, 24)) for _ in range(2))
weight = rng.standard_normal(q.shape)
options = dict(causal=causal, softcap=softcap, window_size=tuple(window_size))

def ring_loss(q, k, v):
    ring = jax.shard_map(lambda a, b, c: cfj.ring_flash_attn(a, b, c, "seq", layout=layout, **options), mesh=mesh,
                         in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
    sharding = jax.sharding.NamedSharding(mesh, P(None, "seq"))
    slices = (jax.device_put(cfj.shard_sequence(x, world, layout), sharding) for x in (q, k, v))
    out = cfj.unshard_sequence(ring(*slices), world, layout)
    return (out * weight).sum(), out

def full_loss(q, k, v):
    out = cfj.flash_attn(q, k, v, **options)
    return (out * weight).sum(), out

(_, got), got_grads = jax.value_and_grad(ring_loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
(_, want), want_grads = jax.value_and_grad(full_loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
print(json.dumps([float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
                  for a, b in zip((got, *got_grads), (want, *want_grads))]))
"""


@pytest.mark.parametrize("world, layout, causal, nheads_k, softcap, seqlen, window_size", [
    (2, "zigzag", True, 2, 0.0, 48, (-1, -1)),
    (2, "contiguous", False, 4, 3.0, 40, (-1, -1)),
    (4, "zigzag", True, 1, 2.5, 64, (-1, -1)),
    (4, "contiguous", True, 2, 0.0, 36, (-1, -1)),
    (4, "zigzag", True, 2, 0.0, 64, (9, -1)),
    (2, "contiguous", False, 1, 1.5, 40, (6, 13)),
])
def test_the_ring_under_shard_map_gives_whole_sequence_attention(world, layout, causal, nheads_k, softcap, seqlen,
                                                                 window_size):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(sys.path))
    case = json.dumps([world, layout, causal, nheads_k, softcap, seqlen, window_size])
    run = subprocess.run([sys.executable, "-c", _SCRIPT, case], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert max(errors) <= 1e-12, dict(zip(("out", "dq", "dk", "dv"), errors))


def test_sharding_a_sequence_and_back_is_the_identity():
    import numpy as np
    import cupyflash.jax as cfj
    x = np.arange(2 * 24 * 3).reshape(2, 24, 3)
    for world, layout in ((2, "zigzag"), (3, "zigzag"), (4, "contiguous")):
        sharded = np.asarray(cfj.shard_sequence(x, world, layout))
        np.testing.assert_array_equal(np.asarray(cfj.unshard_sequence(sharded, world, layout)), x)
    zigzag = np.asarray(cfj.shard_sequence(x, 2, "zigzag"))[0, :, 0] // 3  # positions: chunks 0, 3 | 1, 2 of 6
    np.testing.assert_array_equal(zigzag, np.concatenate([np.arange(0, 6), np.arange(18, 24), np.arange(6, 18)]))
