"""The kernels' parameter block, read from cuda_src/common/params.cuh so Python and CUDA share one definition.

Each field line of `struct FlashParams` becomes a field of a NumPy structured dtype with C alignment
(NumPy's align=True follows the C layout rules for these scalar types). Any other line in the struct
is an error here, and `size_assert()` makes the compiler check the total size (NVRTC has no offsetof).
"""

import functools
import re

import numpy

from . import _sources

_C_TYPES = {
    "const void*": numpy.uint64,
    "void*": numpy.uint64,
    "float*": numpy.uint64,
    "const float*": numpy.uint64,
    "const int*": numpy.uint64,
    "int*": numpy.uint64,
    "long long": numpy.int64,
    "int": numpy.int32,
    "float": numpy.float32,
}
_FIELD = re.compile(r"^\s*(const void\*|void\*|const float\*|float\*|const int\*|int\*|long long|int|float)\s+(\w+);")


@functools.cache
def params_dtype():
    return parse_struct(_sources.read("common/params.cuh"))


def parse_struct(text):
    """The NumPy dtype of `struct FlashParams { ... };` in `text`; refuses lines it cannot map."""
    body = text[text.index("struct FlashParams {"):]
    body = body[: body.index("};")]
    fields = []
    for line in body.splitlines()[1:]:
        code = line.split("//")[0].strip()
        if not code:
            continue
        match = _FIELD.match(code)
        if match is None:
            raise RuntimeError(f"cuda_src/common/params.cuh: cannot map this FlashParams line to NumPy: {line.strip()!r}")
        fields.append((match.group(2), _C_TYPES[match.group(1)]))
    return numpy.dtype(fields, align=True)


def size_assert():
    """A C++ static_assert that the struct is as large as the NumPy dtype."""
    size = params_dtype().itemsize
    return f"static_assert(sizeof(FlashParams) == {size}, \"FlashParams differs from cupyflash/_params.py\");"


def make_params(**values):
    """A FlashParams value, every field not given set to zero: a size-1 structured array, which
    CuPy passes to a kernel by value. Built from one tuple, since it is made on every launch."""
    dtype = params_dtype()
    unknown = set(values) - set(dtype.names)
    if unknown:
        raise KeyError(f"unknown FlashParams fields: {sorted(unknown)}")
    return numpy.array([tuple(values.get(name, 0) for name in dtype.names)], dtype=dtype)
