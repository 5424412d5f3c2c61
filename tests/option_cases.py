"""THE single test matrix of attention options, shared by the PyTorch and the JAX adapter tests
(test_torch_*.py through torch_helpers, test_jax_*.py through jax_helpers), derived from the options
table (cupyflash.options.settings): one case per option, per form for arrays, and one with all of
them; a new option joins the matrix by its row alone.

OPTIONS maps a case name to the keyword options of one flash_attn call. An array option's value is
its form, which each framework's `_make_options` turns into an array for the call's shape through
the option's example (cupyflash.options.Option.example). The two adapters spell two things
differently, so each takes the matrix through its function below, which renames or splits those
entries in place and leaves every other entry as it is.
"""

from cupyflash import options as cupyflash_options
from cupyflash._check import Case

OPTIONS = dict(cupyflash_options.settings(), **{"window_size-left-only": dict(window_size=[2, -1])})

# The GPU cases of both adapters: each option, a mix of them, varlen; odd lengths, GQA, both dtypes.
GPU_CASES = [
    Case(113, 200, 96, "float16", False, nheads=4, nheads_k=4, window_size=(37, 11)),
    Case(200, 113, 64, "bfloat16", True, nheads=4, nheads_k=2, softcap=1.5),
    Case(113, 200, 64, "bfloat16", True, nheads=4, nheads_k=1, alibi_slopes=True),
    Case(113, 150, 64, "bfloat16", False, attn_bias="full"),
    Case(113, 150, 64, "float16", True, nheads=4, nheads_k=2, attn_bias="heads"),
    Case(113, 150, 128, "bfloat16", False, batch=3, attn_bias="keys", deterministic=True),
    Case(150, 113, 64, "bfloat16", True, nheads=4, nheads_k=2, attn_bias="padding"),
    Case(113, 200, 64, "float16", True, nheads=4, nheads_k=2, dropout_p=0.17),
    Case(200, 113, 128, "bfloat16", False, deterministic=True),
    Case(257, 300, 128, "bfloat16", True, window_size=(100, 20), softcap=3.0, alibi_slopes=True, attn_bias="full", dropout_p=0.1,
         deterministic=True),
    Case.packed((0, 1, 17, 113, 5), (3, 0, 17, 200, 5), 64, "bfloat16", True, nheads=4, nheads_k=2),
    Case.packed((0, 1, 17, 113, 5), (3, 0, 17, 200, 5), 64, "float16", False, nheads=4, nheads_k=2, window_size=(20, 5),
                alibi_slopes=True, dropout_p=0.2),
    Case.packed((1000, 17), (113, 1000), 128, "bfloat16", True, nheads=4, nheads_k=4, softcap=1.5,
                deterministic=True),
    # no query rows at all, and no key rows at all: the results without elements come back empty
    Case.packed((0, 0), (3, 40), 64, "bfloat16", True, nheads=4, nheads_k=2),
    Case.packed((3, 40), (0, 0), 128, "float16", False, nheads=4, nheads_k=2, alibi_slopes=True),
]

# The bitwise-repeatability cases of both adapters' deterministic backward.
DETERMINISTIC_CASES = [Case(300, 300, 128, "bfloat16", True, nheads=8, nheads_k=2, deterministic=True, alibi_slopes=True,
                            attn_bias="keys"),
                       Case.packed((300, 17, 200), (300, 500, 17), 64, "float16", False, nheads=4, nheads_k=1,
                                   deterministic=True)]

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
    return _respelled(OPTIONS, {"attn_bias-keys": [("attn_bias-keys-float32", dict(attn_bias="keys-float32"))]})


def jax_options():
    """cupyflash.jax: biases are float32; dropout needs its seed as an argument, either a uint32 (2,) array
    ("array": random, drawn by _make_options) or an int, so 'dropout' is tried with both."""
    return _respelled(OPTIONS, {
        "dropout_p": [("dropout_p-array-seed", dict(OPTIONS["dropout_p"], dropout_seed="array")),
                      ("dropout_p-int-seed", dict(OPTIONS["dropout_p"], dropout_seed=2 ** 63 + 12345))],
        "all": [("all", dict(OPTIONS["all"], dropout_seed="array"))],
    })


def varlen_options(options):
    """The matrix without what the varlen functions do not take (attn_bias): such entries dropped,
    and 'all' without those options."""
    def taken(name):
        return name not in [o.name for o in cupyflash_options.OPTIONS] or cupyflash_options.by_name(name).varlen
    result = {name: spec for name, spec in options.items() if all(taken(n) for n in spec)}
    result["all"] = {name: value for name, value in options["all"].items() if taken(name)}
    return result
