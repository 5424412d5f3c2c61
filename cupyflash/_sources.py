"""The CUDA sources shipped with the package, read through importlib.resources.

`translation_unit()` inlines every local `#include "..."` so that the text handed to the compiler
(and hashed as the cache key) contains every header it depends on: editing a .cuh can never
give a stale binary. Headers are named by their path under cuda_src/ ("sm80/fwd.cuh"), and an
include is relative to the including header's folder, as in C ("../common/mask.cuh").
"""

import functools
import importlib.resources
import pathlib
import posixpath
import re

_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)


def _source_dir():
    # Installed, or editable: the package cupyflash.cuda_src (setup.cfg maps it to cuda_src/).
    # A plain source checkout on sys.path: ../cuda_src.
    try:
        return importlib.resources.files("cupyflash.cuda_src")
    except ModuleNotFoundError:
        return pathlib.Path(__file__).resolve().parent.parent / "cuda_src"


@functools.cache
def read(name):
    """The text of header `name`, a path under cuda_src/ such as "common/params.cuh"."""
    path = _source_dir()
    for part in name.split("/"):  # one part at a time: a namespace package's MultiplexedPath takes one
        path = path / part
    return path.read_text()


def translation_unit(root_header, seen=None):
    """The header `root_header` with its local includes inlined, each header once."""
    seen = set() if seen is None else seen
    if root_header in seen:
        return ""
    seen.add(root_header)
    text = read(root_header).replace("#pragma once", "")
    folder = posixpath.dirname(root_header)
    return _INCLUDE.sub(lambda m: translation_unit(posixpath.normpath(posixpath.join(folder, m.group(1))), seen), text)
