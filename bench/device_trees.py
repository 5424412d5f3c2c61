"""Prepares versions of cupyflash for a device call: one tree per version and one kernel cache
for all of them, packed to travel as `carry` (bench/DEVICE.md says how a call uses them).

    python bench/device_trees.py DIR main=HEAD pdl=HEAD+bench/notes/x.patch [--kernels ab|all]

A version is NAME=REV[+PATCH...]: `git archive REV` of cupyflash/, cuda_src/, tests/ and
setup.cfg into DIR/NAME, then each patch applied with `patch -p1`. The kernels compile here with
NVRTC (no GPU), each version with its own code, into .device_cache/ (git-ignored, kept between
runs: an unchanged kernel compiles once for every version), which DIR/cache.tar.xz then holds, so
that DIR alone travels (well under the 64 MiB a call carries): `ab` (default) the
kernels bench/ab.py times (bf16: the plain and causal fwd and bwd, and decode), `all` every sm_90
variant of the compile checks (about 4 minutes a version on two cores).
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

REPO = pathlib.Path(__file__).resolve().parent.parent
PATHS = ("cupyflash", "cuda_src", "tests", "setup.cfg")
COMPILE_ALL = """
from cupyflash import _compile, _kernels
if __name__ == "__main__":
    jobs = [(arch, k) for arch, k in _kernels.compile_jobs() if arch.startswith("90")]
    unclean = [k.name for _, k, report in _compile.compile_all(jobs) if not report.clean]
    print({"kernels": len(jobs), "unclean": unclean, "code": _compile.__file__})
"""


def make_tree(directory, spec):
    """DIR/NAME from NAME=REV[+PATCH...]; returns its path."""
    name, _, version = spec.partition("=")
    if not name or not version:
        raise SystemExit(f"a version is NAME=REV[+PATCH...], got {spec!r}")
    revision, *patches = version.split("+")
    tree = directory / name
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, *PATHS], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    for patch in patches:
        with open(REPO / patch, "rb") as f:  # (an absolute path stays itself)
            subprocess.run(["patch", "-p1", "-s", "-d", str(tree)], stdin=f, check=True)
    return tree


def compile_kernels(tree, cache, which):
    env = dict(os.environ, PYTHONPATH=str(tree), CUPYFLASH_CACHE_DIR=str(cache))
    if which == "all":
        commands = [[sys.executable, "-c", COMPILE_ALL]]
    else:
        commands = [[sys.executable, str(REPO / "bench" / "ab.py"), "--compile", "--pass", pass_, str(tree)]
                    for pass_ in ("fwd", "bwd", "decode")]
    for command in commands:
        # (from the tree: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH)
        done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{tree.name}: compiling failed\n{done.stderr[-2000:]}")
        print(tree.name, done.stdout.strip().splitlines()[-1], flush=True)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=pathlib.Path, help="where the trees and the cache go (git-ignored)")
    parser.add_argument("versions", nargs="+", help="NAME=REV[+PATCH...]")
    parser.add_argument("--kernels", choices=("ab", "all"), default="ab")
    args = parser.parse_args(argv)
    directory = args.directory.resolve()
    cache = REPO / ".device_cache"
    cache.mkdir(parents=True, exist_ok=True)
    for spec in args.versions:
        compile_kernels(make_tree(directory, spec), cache, args.kernels)
    with tarfile.open(directory / "cache.tar.xz", "w:xz") as archive:
        archive.add(cache, arcname="cache")
    print(json.dumps({"trees": [s.partition("=")[0] for s in args.versions],
                      "cache files": len(list(cache.iterdir())), "carry": os.path.relpath(directory, REPO)}))


if __name__ == "__main__":
    main(sys.argv[1:])
