"""The GPU test suite in parts, so that a device call (at most 600 s, and better under 330 s: a call
that dies loses everything it wrote) runs one part and the next call the next.

    PYTHONPATH=. python bench/gpu_suite.py --part 2/3 [-- PYTEST ARGS]   # e.g. -- -n 12 -v

The tests marked `gpu` under tests/ are collected (`pytest --collect-only`), kept in collection order
and cut into N runs of about as many tests each, whole files kept together where a cut would fall
within a few tests of a file's end; part i runs through pytest.main (test ids hold spaces, which a
shell word list would split). Run it from the tree the tests belong to; CUPYFLASH_FAMILY=mma_sync
before it runs the older family's.
"""

import argparse
import subprocess
import sys

SLACK = 8  # tests by which a cut may move to fall on a file boundary


def collect(paths, markers="gpu"):
    """The node ids pytest collects under `paths` with `markers`, in order."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                           markers, *paths], capture_output=True, text=True)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no tests collected:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return ids


def parts(ids, count):
    """`ids` cut into `count` contiguous runs of about equal length, each cut moved to the nearest file
    boundary within SLACK tests."""
    if not 1 <= count <= len(ids):
        raise SystemExit(f"{len(ids)} tests cannot make {count} parts")
    starts = [0]
    for i in range(1, count):
        low, high = starts[-1] + 1, len(ids) - (count - i)  # every part keeps a test
        cut = min(max(round(i * len(ids) / count), low), high)
        boundaries = [j for j in range(max(cut - SLACK, low), min(cut + SLACK, high) + 1)
                      if ids[j].split("::")[0] != ids[j - 1].split("::")[0]]
        starts.append(min(boundaries, key=lambda j: abs(j - cut)) if boundaries else cut)
    return [ids[a:b] for a, b in zip(starts, starts[1:] + [len(ids)])]


def main(argv):
    own, _, extra = (argv[:argv.index("--")], None, argv[argv.index("--") + 1:]) if "--" in argv else (argv, None, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", required=True, help="I/N: the I-th of N parts (1-based)")
    parser.add_argument("--tests", nargs="*", default=["tests"], help="paths to collect (default: tests)")
    args = parser.parse_args(own)
    index, count = (int(x) for x in args.part.split("/"))
    if not 1 <= index <= count:
        parser.error(f"--part wants I/N with 1 <= I <= N, got {args.part}")
    chosen = parts(collect(args.tests), count)[index - 1]
    print(f"part {index}/{count}: {len(chosen)} tests, {chosen[0]} .. {chosen[-1]}", flush=True)
    import pytest
    return pytest.main(["-m", "gpu", "-p", "no:cacheprovider", *extra, *chosen])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
