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
times with those options. --named FILE adds the sm_90 kernels named in FILE, one name a line
(bench/device-test-kernels.txt: what the GPU tests compiled beyond `all` in an earlier call, read
off that call's newcache.tar.xz), so that a call's tests do not spend its minutes compiling them.
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
# A tree's sm_90 kernels compiled into the cache, as `python -c COMPILE MODE`: `all` every variant
# of the compile checks, `kvcache` the KV cache's among them, `named FILE` the variants the tables
# allow (any subset of the features) whose names FILE lists.
# (EVERY_VARIANT, run in a tree, is also how bench/sass.py --named finds kernels by their names.)
EVERY_VARIANT = """
import itertools
from cupyflash import _config, _kernels


def every_variant():
    for kernel_family, archs in _config.COMPILE_CHECKS.items():
        for arch, families in ((a, f) for a, f in archs.items() if a.startswith("90")):
            for (table, tile), dtype, local, even_k, deterministic, bias_tiles in itertools.product(
                    _config.all_tiles(families, kernel_family), _kernels.DTYPES, *[(False, True)] * 4):
                pass_ = _config.kernel_pass(table)
                allowed = _kernels.DECODE_FEATURES if pass_ == "decode" else _kernels.FEATURES
                for features in (f for n in range(len(allowed) + 1) for f in itertools.combinations(allowed, n)):
                    try:
                        yield arch, _kernels.Kernel(pass_, dtype, tile, local, even_k, features, deterministic, bias_tiles)
                    except ValueError:
                        pass


def named_variants(path):
    names = set(open(path).read().split())
    return names, list({k.name: (arch, k) for arch, k in every_variant() if k.name in names}.values())
"""
COMPILE = EVERY_VARIANT + """
import json, sys
from cupyflash import _compile


if __name__ == "__main__":
    mode, report = sys.argv[1], {}
    if mode == "named":
        names, jobs = named_variants(sys.argv[2])
        report["unknown"] = sorted(names - {k.name for _, k in jobs})
    else:
        jobs = [(arch, k) for arch, k in _kernels.compile_jobs()
                if arch.startswith("90") and (mode == "all" or k.pass_ in _kernels.KVCACHE_PASSES)]
    report["kernels"] = len(jobs)
    report["unclean"] = [k.name for _, k, result in _compile.compile_all(jobs) if not result.clean]
    report["code"] = _compile.__file__
    report["files"] = [_compile.compile_kernel(k, arch)[0].name for arch, k in jobs]  # (compiled: the cache's paths)
    print(json.dumps(report))
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


def compile_kernels(tree, cache, which, options, dtypes, named=None):
    """Compiles the tree's kernels into `cache`; returns the names of the cache files they are."""
    env = dict(os.environ, PYTHONPATH=str(tree), CUPYFLASH_CACHE_DIR=str(cache))
    ab = [sys.executable, str(REPO / "bench" / "ab.py"), "--worker-compile"]
    commands = [[sys.executable, "-c", COMPILE, "all"]] if which == "all" else (
        [[*ab, "--pass", pass_, "--dtype", dtype] for pass_ in ("fwd", "bwd") for dtype in dtypes]
        + [[*ab, "--pass", "decode"]])
    if which == "kvcache":
        commands.append([sys.executable, "-c", COMPILE, "kvcache"])
    commands += [[*ab, "--pass", pass_, "--options", given] for given in options for pass_ in ("fwd", "bwd")]
    if named is not None:
        commands.append([sys.executable, "-c", COMPILE, "named", str(named.resolve())])
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
    parser.add_argument("--named", type=pathlib.Path, help="a file of kernel names to add (sm_90 variants)")
    args = parser.parse_args(argv)
    directory = args.directory.resolve()
    cache = REPO / ".device_cache"
    cache.mkdir(parents=True, exist_ok=True)
    files = set()
    for spec in args.versions:
        files |= compile_kernels(make_tree(directory, spec), cache, args.kernels, args.options, args.dtypes,
                                 args.named)
    with tarfile.open(directory / "cache.tar.xz", "w:xz") as archive:
        for name in sorted(files):
            archive.add(cache / name, arcname=f"cache/{name}")
    print(json.dumps({"trees": [s.partition("=")[0] for s in args.versions], "cache files": len(files),
                      "carry": os.path.relpath(directory, REPO)}))


if __name__ == "__main__":
    main(sys.argv[1:])
