"""The CUDA sources shipped with the package, read through importlib.resources.

`translation_unit()` inlines every local `#include "..."` so that the text handed to the compiler
(and hashed as the cache key) contains every header it depends on: editing a .cuh can never
give a stale binary.
"""

import functools
import importlib.resources
import pathlib
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
    return (_source_dir() / name).read_text()


def translation_unit(root_header, seen=None):
    """The header `root_header` with its local includes inlined, each header once."""
    seen = set() if seen is None else seen
    if root_header in seen:
        return ""
    seen.add(root_header)
    text = read(root_header).replace("#pragma once", "")
    return _INCLUDE.sub(lambda m: translation_unit(m.group(1), seen), text)
