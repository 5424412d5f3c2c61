"""Prepares versions of cupyflash for a device call: one tree per version and one kernel cache
for all of them, packed to travel as `carry` (bench/DEVICE.md says how a call uses them).

    python bench/device_trees.py DIR main=HEAD pdl=HEAD+bench/notes/x.patch [--kernels ab|all]
                                 [--options '{"softcap": 30.0}' ...] [--dtypes bfloat16 float16]

A version is NAME=REV[+PATCH...]: `git archive REV` of cupyflash/, cuda_src/, tests/ and
setup.cfg into DIR/NAME, then each patch applied with `patch -p1`. The kernels compile here with
NVRTC (no GPU), each version with its own code, into .device_cache/ (git-ignored, kept between
runs: an unchanged kernel compiles once for every version); DIR/cache.tar.xz then holds the
versions' kernels (not the rest of that cache), so that DIR alone travels (well under the 64 MiB a
call carries): `ab` (default) the kernels bench/ab.py times (the plain and causal fwd and bwd in
each of --dtypes, bf16 unless told, and decode), `all` every sm_90 variant of the compile checks
(about 4 minutes a version on two cores), `kvcache` ab's and every sm_90 variant of the KV cache's
kernels (what its GPU tests run), and with each --options the forwards and backwards bench/ab.py
times with those options.
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
import json, sys
from cupyflash import _compile, _kernels
if __name__ == "__main__":
    kvcache_only = sys.argv[1:] == ["kvcache"]
    jobs = [(arch, k) for arch, k in _kernels.compile_jobs()
            if arch.startswith("90") and (not kvcache_only or k.pass_ in _kernels.KVCACHE_PASSES)]
    unclean = [k.name for _, k, report in _compile.compile_all(jobs) if not report.clean]
    files = [_compile.compile_kernel(k, arch)[0].name for arch, k in jobs]  # (compiled: the cache's paths)
    print(json.dumps({"kernels": len(jobs), "unclean": unclean, "code": _compile.__file__, "files": files}))
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


def compile_kernels(tree, cache, which, options, dtypes):
    """Compiles the tree's kernels into `cache`; returns the names of the cache files they are."""
    env = dict(os.environ, PYTHONPATH=str(tree), CUPYFLASH_CACHE_DIR=str(cache))
    ab = [sys.executable, str(REPO / "bench" / "ab.py"), "--worker-compile"]
    commands = [[sys.executable, "-c", COMPILE_ALL]] if which == "all" else (
        [[*ab, "--pass", pass_, "--dtype", dtype] for pass_ in ("fwd", "bwd") for dtype in dtypes]
        + [[*ab, "--pass", "decode"]])
    if which == "kvcache":
        commands.append([sys.executable, "-c", COMPILE_ALL, "kvcache"])
    commands += [[*ab, "--pass", pass_, "--options", given] for given in options for pass_ in ("fwd", "bwd")]
    files = set()
    for command in commands:
        # (from the tree: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH)
        done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{tree.name}: compiling failed\n{done.stderr[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        files.update(result.pop("files"))
        print(tree.name, result, flush=True)
    return {name for cubin in files for name in (cubin, cubin.removesuffix(".cubin") + ".log")}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=pathlib.Path, help="where the trees and the cache go (git-ignored)")
    parser.add_argument("versions", nargs="+", help="NAME=REV[+PATCH...]")
    parser.add_argument("--kernels", choices=("ab", "all", "kvcache"), default="ab")
    parser.add_argument("--options", action="append", default=[],
                        help="JSON options of a forward A/B (bench/ab.py --options) whose kernels to add; repeatable")
    parser.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float16"), default=["bfloat16"],
                        help="the dtypes of `ab`'s plain kernels (the speed grid runs both)")
    args = parser.parse_args(argv)
    directory = args.directory.resolve()
    cache = REPO / ".device_cache"
    cache.mkdir(parents=True, exist_ok=True)
    files = set()
    for spec in args.versions:
        files |= compile_kernels(make_tree(directory, spec), cache, args.kernels, args.options, args.dtypes)
    with tarfile.open(directory / "cache.tar.xz", "w:xz") as archive:
        for name in sorted(files):
            archive.add(cache / name, arcname=f"cache/{name}")
    print(json.dumps({"trees": [s.partition("=")[0] for s in args.versions], "cache files": len(files),
                      "carry": os.path.relpath(directory, REPO)}))


if __name__ == "__main__":
    main(sys.argv[1:])
