"""THE single test matrix of attention options, shared by the PyTorch and the JAX adapter tests
(test_torch_*.py through torch_helpers, test_jax_*.py through jax_helpers). Edit it here only.

OPTIONS maps a case name to the keyword options of one flash_attn call. A string value stands for
an array that each framework's `_make_options` builds for the call's shape:
  alibi_slopes: "(nheads,)" or "(batch, nheads)" (random slopes);
  attn_bias: "full" (batch, nheads, seqlen_q, seqlen_k), "heads" (nheads, seqlen_q, seqlen_k) or
  "keys" (seqlen_q, seqlen_k) (random normal values, requiring a gradient).
The two adapters spell two things differently, so each takes the matrix through its function
below, which renames or splits those entries in place and leaves every other entry as it is.
"""

OPTIONS = {
    "window": dict(window_size=(3, 1)),
    "window-left-only": dict(window_size=[2, -1]),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes="(nheads,)"),
    "alibi-per-batch": dict(alibi_slopes="(batch, nheads)"),
    "bias-full": dict(attn_bias="full"),
    "bias-heads": dict(attn_bias="heads"),
    "bias-keys": dict(attn_bias="keys"),
    "dropout": dict(dropout_p=0.3),
    "deterministic": dict(deterministic=True),
    "all": dict(window_size=(4, 2), softcap=2.0, alibi_slopes="(batch, nheads)", attn_bias="full", dropout_p=0.25,
                deterministic=True),
}

# The shapes the matrix runs at: (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal).
OPTION_SHAPES = [(2, 9, 11, 4, 2, 16, False), (2, 9, 11, 4, 2, 16, True),
                 (1, 11, 7, 2, 1, 8, True)]  # rows that see no key
# Per-sequence lengths (q, k) of the varlen tests: an empty query side, and with causal rows that see no key.
LENGTHS = ((3, 0, 6, 1), (4, 2, 5, 1))


def _respelled(options, changes):
    """`options` with each entry named in `changes` replaced, at its place, by the (name, spec) pairs given."""
    result = {}
    for name, spec in options.items():
        for new_name, new_spec in changes.get(name, [(name, spec)]):
            result[new_name] = new_spec
    return result


def torch_options():
    """cupyflash.torch: a bias goes in q's dtype unless it is float32, so the 'keys' bias is the float32 one
    ('keys-float32'); the dropout seed comes from torch's generator (no option for it)."""
    return _respelled(OPTIONS, {"bias-keys": [("bias-keys-float32", dict(attn_bias="keys-float32"))]})


def jax_options():
    """cupyflash.jax: biases are float32; dropout needs its seed as an argument, either a uint32 (2,) array
    ("array": random, drawn by _make_options) or an int, so 'dropout' is tried with both."""
    return _respelled(OPTIONS, {
        "dropout": [("dropout-array-seed", dict(OPTIONS["dropout"], dropout_seed="array")),
                    ("dropout-int-seed", dict(OPTIONS["dropout"], dropout_seed=2 ** 63 + 12345))],
        "all": [("all", dict(OPTIONS["all"], dropout_seed="array"))],
    })


def varlen_options(options):
    """The varlen functions take no attn_bias: the bias entries dropped, and 'all' without it."""
    result = {name: spec for name, spec in options.items() if "bias" not in name}
    result["all"] = {name: value for name, value in options["all"].items() if name != "attn_bias"}
    return result
