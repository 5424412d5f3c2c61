"""The SASS of versions of cupyflash, read here (NVRTC and nvdisasm need no GPU): which kernels a
change altered, and the sizes of their loops, before any device call.

    python bench/sass.py diff TREE_A TREE_B [FILTER ...]   # per kernel: identical, or what moved
    python bench/sass.py loops TREE [FILTER ...]            # per kernel: its loops' sizes and opcodes
    python bench/sass.py blocks TREE [FILTER ...]           # per kernel: its step loops' basic blocks
    python bench/sass.py steps TREE_A TREE_B [FILTER ...]  # per kernel: its step loops' sizes, and what changed
    python bench/sass.py stalls TREE [FILTER ...] [--listing]  # per kernel: its step loops' scheduled stalls

A TREE is a directory holding one version's cupyflash/ and cuda_src/ (as bench/ab.py's), or `.`.
The kernels are the sm_90 ones of `--dtype` (without options unless `--options`) whose names hold every FILTER; each
tree compiles them with its own code (a process run from the tree) into one cache, keyed by the
source as the package keys it (CUPYFLASH_CACHE_DIR, else .device_cache/, which device_trees.py
fills). `diff` compares the instruction streams without addresses; a refactor that leaves them
identical needs no device call to show it changed nothing. `loops` lists each backward branch
spanning more than --min instructions (a main loop's instruction count predicted v44's two
landed changes), and ptxas's coded messages (C7520: it serialised the kernel's wgmmas). `blocks`
splits the step loops (the innermost ones with exps, MUFU.EX2) into basic blocks, each with
its size, label, closing branch and opcodes: which blocks a step skips (a mask, O's rescale) says
how many instructions it executes, and an option's executed count over the plain kernel's predicted
its cost (v49). `steps` compares two trees' step loops instruction by instruction, registers and
constants aside (v65: a persistent kernel's step that recomputed the shared-window base, `S2UR
SR_CgaCtaId`, in every step). `stalls` reads the control bits ptxas codes beside each instruction
(from nvdisasm's encodings): the cycles a warp waits before its next instruction issues, and
whether it first waits on a scoreboard (a variable-latency result: MUFU, shared memory, shuffles).
A step's stall cycles are a floor on one warp's time for it; ncu's "wait" stall reason is their
excess over one a instruction (v73: hd128's step 1144 cycles for 502 instructions, 528 of them
the 66 exps' 8 cycles each). Each step is also cut at its barriers and waits, the points where a
warp may wait on others: the segments between them are its own work (v74's chain budget).
`--options` takes the option kernels too; `--named FILE` the kernels FILE names instead (any variant the
tables allow, such as an option alone: bench/device_trees.py's list). nvdisasm comes from $NVDISASM or PATH
(`pip download --no-deps nvidia-cuda-nvdisasm`, unzipped outside the checkout; not a dependency of
the package).
"""

import argparse
import collections
import difflib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import device_trees  # (bench/, beside this file)

REPO = pathlib.Path(__file__).resolve().parent.parent
CUBINS = device_trees.EVERY_VARIANT + """
import json, re, sys
from cupyflash import _compile
if __name__ == "__main__":
    dtype, with_options, named, filters = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4:]
    if named:
        jobs = named_variants(named)[1]
    else:
        jobs = [(arch, k) for arch, k in _kernels.compile_jobs() if arch.startswith("90") and k.dtype == dtype
                and (with_options or not k.options)]
    jobs = [(arch, k) for arch, k in jobs if all(f in k.name for f in filters)]
    reports = _compile.compile_all(jobs)
    kernels = {}
    for arch, k, r in reports:
        cubin, log = _compile.compile_kernel(k, arch)
        notes = sorted(set(re.findall(r"\\((C\\d{4})\\)", log)))
        kernels[k.name] = [str(cubin), r.registers, r.spills, {code: log.count(f"({code})") for code in notes}]
    print(json.dumps({"code": _compile.__file__, "kernels": kernels}))
"""
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^(\.L_x_\d+):")
ENCODING_HIGH = re.compile(r"^\s+/\* (0x[0-9a-f]{16}) \*/\s*$")  # -hex's second line of an instruction
Control = collections.namedtuple("Control", "stall write_barrier read_barrier waits")
OPCODE = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def cubins(tree, dtype, filters, with_options=False, named=None):
    """{kernel name: (cubin path, registers, spill bytes, {ptxas message code: count})} of `tree`'s kernels."""
    tree = tree.resolve()
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.setdefault("CUPYFLASH_CACHE_DIR", str(REPO / ".device_cache"))
    named = str(named.resolve()) if named else ""
    done = subprocess.run([sys.executable, "-c", CUBINS, dtype, str(int(with_options)), named, *filters], cwd=tree,
                          env=env, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not pathlib.Path(result["code"]).resolve().is_relative_to(tree):
        raise SystemExit(f"{tree}: compiled {result['code']}, not the tree's code")
    return result["kernels"]


def nvdisasm():
    tool = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not tool:
        raise SystemExit("nvdisasm not found: set NVDISASM (see this file's docstring)")
    return tool


def disassembly(cubin):
    """nvdisasm's listing of a cubin's code, each instruction's encoding beside it (-hex), which
    parse() passes over and parse_controls() reads."""
    return subprocess.run([nvdisasm(), "-hex", "-c", cubin], check=True, capture_output=True, text=True).stdout


def listing(cubin):
    """parse() of a cubin's code."""
    return parse(disassembly(cubin))


def parse(text):
    """[(label, None) or (None, instruction text without its address)] of nvdisasm's output, in order."""
    lines = []
    for line in text.splitlines():
        label, instruction = LABEL.match(line), INSTRUCTION.match(line)
        if label:
            lines.append((label.group(1), None))
        elif instruction:
            lines.append((None, instruction.group(1)))
    return lines


def control(high_word):
    """The Control of an instruction from the high 64 bits of its encoding (sm_70 and later: bits
    105-121): stall cycles, the scoreboards it sets on write and on read (None: none), the
    scoreboards it waits on (a mask)."""
    bits = high_word >> 41
    barrier = lambda b: None if b == 7 else b  # noqa: E731
    return Control(bits & 15, barrier((bits >> 5) & 7), barrier((bits >> 8) & 7), (bits >> 11) & 63)


def parse_controls(text):
    """[Control] of nvdisasm -hex's output, one an instruction, in parse()'s order."""
    return [control(int(m.group(1), 16)) for m in map(ENCODING_HIGH.match, text.splitlines()) if m]


def control_listing(cubin):
    """(parse(), parse_controls()) of a cubin's code."""
    text = disassembly(cubin)
    return parse(text), parse_controls(text)


def stalls(texts, controls, first, end):
    """(stall cycles, instructions that wait on a scoreboard, {opcode: (stall cycles, count)}) of
    instructions first:end."""
    by_opcode = collections.defaultdict(lambda: [0, 0])
    for text, c in zip(texts[first:end], controls[first:end]):
        entry = by_opcode[OPCODE.match(text).group(1)]
        entry[0] += c.stall
        entry[1] += 1
    return (sum(cycles for cycles, _ in by_opcode.values()), sum(1 for c in controls[first:end] if c.waits),
            {op: tuple(v) for op, v in by_opcode.items()})


SEGMENT_ENDS = re.compile(r"\bBAR\.(SYNC|ARV)\b|WARPGROUP\.DEPBAR|SYNCS\.PHASECHK")


def segments(texts, controls, first, end):
    """[(stall cycles, instruction count, the instruction that ends the segment or None)] of
    instructions first:end cut at each barrier, wgmma wait or mbarrier wait: what one warp spends
    between the points where it may wait on others (v74: a consumer's step split into its turn's
    products, its softmax and its tail)."""
    found, cycles, count = [], 0, 0
    for text, c in zip(texts[first:end], controls[first:end]):
        if SEGMENT_ENDS.search(text):
            found.append((cycles, count, text))
            cycles = count = 0
        cycles += c.stall
        count += 1
    found.append((cycles, count, None))
    return found


def instructions(lines):
    return [text for label, text in lines if text is not None]


def opcodes(texts):
    return collections.Counter(OPCODE.match(text).group(1) for text in texts)


def loop_spans(lines, shortest):
    """[(first, end)] instruction indices of each backward branch over at least `shortest` instructions."""
    where, count, found = {}, 0, []
    for label, text in lines:
        if label:
            where[label] = count
            continue
        count += 1
        target = re.search(r"`\((\.L_x_\d+)\)", text)
        if "BRA" in text and target and target.group(1) in where and count - where[target.group(1)] >= shortest:
            found.append((where[target.group(1)], count))
    return found


def loops(lines, shortest):
    """[(instruction count, opcode Counter)] of each backward branch over at least `shortest` instructions."""
    texts = instructions(lines)
    return [(end - first, opcodes(texts[first:end])) for first, end in loop_spans(lines, shortest)]


def basic_blocks(lines, first, end):
    """[(first, end, labels, closing branch or None)] of instructions first:end: a block starts at a
    label or after a branch."""
    labels, count = {}, 0
    for label, text in lines:
        if label:
            labels.setdefault(count, []).append(label)
        else:
            count += 1
    texts, blocks, start = instructions(lines), [], first
    for i in range(first, end):
        if i in labels and i != start:
            blocks.append((start, i, labels.get(start, []), None))
            start = i
        if OPCODE.match(texts[i]).group(1) == "BRA":
            blocks.append((start, i + 1, labels.get(start, []), texts[i]))
            start = i + 1
    if start < end:
        blocks.append((start, end, labels.get(start, []), None))
    return blocks


def step_loops(lines, shortest):
    """[(first, end)] of the innermost loops over `shortest` instructions that hold exps (MUFU.EX2):
    a forward's steps over key blocks (one loop per masking where the kernel has several)."""
    texts = instructions(lines)
    spans = [(a, b) for a, b in loop_spans(lines, shortest) if any("MUFU.EX2" in t for t in texts[a:b])]
    return [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]


def normalised(text):
    """An instruction without its registers, constants and labels: what differs between two
    compilations of one step beyond register allocation."""
    return re.sub(r"\bU?R\d+\b", "R", re.sub(r"0x[0-9a-f]+", "#", re.sub(r"\.L_x_\d+", "L", text)))


def step_changes(old_lines, new_lines, shortest):
    """([sizes of old's step loops], [new's], [the normalised instructions each pair of them does not
    share, '-' old's and '+' new's])."""
    loops = []
    for lines in (old_lines, new_lines):
        texts = instructions(lines)
        loops.append([[normalised(t) for t in texts[a:b]] for a, b in step_loops(lines, shortest)])
    changes = [[line for line in difflib.unified_diff(old, new, lineterm="", n=0)
                if line[:1] in "+-" and line[:3] not in ("+++", "---")] for old, new in zip(*loops)]
    return [len(x) for x in loops[0]], [len(x) for x in loops[1]], changes


def print_stalls(cubin, shortest, with_listing=False):
    """`stalls`' report of a cubin's step loops: each loop's stall cycles by opcode, its segments
    between barriers and waits, and with `with_listing` each instruction with its control bits."""
    lines, controls = control_listing(cubin)
    texts = instructions(lines)
    for first, end in step_loops(lines, shortest):
        cycles, waiting, by_opcode = stalls(texts, controls, first, end)
        top = sorted(by_opcode.items(), key=lambda kv: -kv[1][0])[:12]
        print(f"  loop of {end - first}: {cycles} stall cycles ({cycles / (end - first):.2f} an instruction),"
              f" {waiting} wait on a scoreboard; by opcode (cycles/count): "
              + ", ".join(f"{op} {c}/{n}" for op, (c, n) in top))
        for cycles, count, until in segments(texts, controls, first, end):
            print(f"    {cycles:5d} cycles, {count:4d} instructions, until {until or 'the loop ends'}")
        if with_listing:
            for i in range(first, end):
                c = controls[i]
                marks = f"w{'-' if c.write_barrier is None else c.write_barrier}" \
                        f"r{'-' if c.read_barrier is None else c.read_barrier} {c.waits:06b}"
                print(f"    {i - first:4d} s{c.stall:<2d} {marks} {texts[i]}")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("diff", "loops", "blocks", "steps", "stalls"))
    parser.add_argument("trees_and_filters", nargs="+",
                        help="diff, steps: TREE_A TREE_B [FILTER ...]; loops, blocks, stalls: TREE [FILTER ...]")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--options", action="store_true", help="the option kernels too (softcap, alibi, ...)")
    parser.add_argument("--named", type=pathlib.Path,
                        help="the sm_90 kernels named in this file (one a line; any variant, not only the compile checks')")
    parser.add_argument("--min", type=int, default=150, help="loops: the shortest loop listed (instructions)")
    parser.add_argument("--lines", type=int, default=40, help="steps: the changed instructions shown a loop")
    parser.add_argument("--listing", action="store_true",
                        help="stalls: each step instruction with its stall cycles, scoreboards set (w, r) and awaited")
    args = parser.parse_args(argv)
    count = 2 if args.command in ("diff", "steps") else 1  # trees
    trees, filters = [pathlib.Path(t) for t in args.trees_and_filters[:count]], args.trees_and_filters[count:]
    if len(trees) < count:
        parser.error(f"{args.command} takes {count} tree(s)")
    kernels = [cubins(tree, args.dtype, filters, args.options, args.named) for tree in trees]
    if args.command == "blocks":
        for name, (cubin, registers, spills, warnings) in sorted(kernels[0].items()):
            lines = listing(cubin)
            texts = instructions(lines)
            print(name)
            for span in step_loops(lines, args.min):
                print(f"  loop of {span[1] - span[0]}")
                for first, end, labels, branch in basic_blocks(lines, *span):
                    ops = ", ".join(f"{op} {n}" for op, n in opcodes(texts[first:end]).most_common(6))
                    print(f"    [{first - span[0]:4d}, {end - span[0]:4d}) {end - first:4d} {','.join(labels):14s}"
                          f" {branch or '':28s} {ops}")
        return
    if args.command == "stalls":
        for name, (cubin, registers, spills, warnings) in sorted(kernels[0].items()):
            print(name)
            print_stalls(cubin, args.min, args.listing)
        return
    if args.command == "loops":
        for name, (cubin, registers, spills, warnings) in sorted(kernels[0].items()):
            print(f"{name} ({registers} registers, {spills} spill bytes)")
            if warnings:  # C7520: wgmmas serialised; C7519: warpgroup arrives injected
                print("  ptxas: " + ", ".join(f"{code} x{n}" for code, n in warnings.items()))
            for size, ops in loops(listing(cubin), args.min):
                print(f"  loop of {size}: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))
        return
    a, b = kernels
    if args.command == "steps":
        for name in sorted(a.keys() & b.keys()):
            old_sizes, new_sizes, changes = step_changes(listing(a[name][0]), listing(b[name][0]), args.min)
            print(f"{name}: step loops {old_sizes} -> {new_sizes}")
            for changed in changes:
                for line in changed[:args.lines]:
                    print(f"    {line}")
                if len(changed) > args.lines:
                    print(f"    ... {len(changed) - args.lines} more")
        return
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            print(f"{name}: only in {trees[0] if name in a else trees[1]}")
            continue
        old, new = (instructions(listing(k[name][0])) for k in (a, b))
        registers = f", registers {a[name][1]} -> {b[name][1]}" if a[name][1] != b[name][1] else ""
        if a[name][3] != b[name][3]:
            registers += f", ptxas codes {a[name][3]} -> {b[name][3]}"
        if old == new:
            print(f"{name}: identical ({len(old)} instructions{registers})")
            continue
        moved = opcodes(new)
        moved.subtract(opcodes(old))
        changes = ", ".join(f"{op} {n:+d}" for op, n in sorted(moved.items(), key=lambda kv: -abs(kv[1])) if n)
        print(f"{name}: {len(old)} -> {len(new)} instructions{registers}; {changes or 'same opcodes, another order'}")


if __name__ == "__main__":
    main(sys.argv[1:])
