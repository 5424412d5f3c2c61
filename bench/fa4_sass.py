"""FlashAttention-4's Hopper kernels as SASS, read here without a GPU, beside cupyflash's: FA4
compiles its CuTe-DSL kernels for sm_90a on the CPU in torch's fake-tensor mode (it reads the
target from FLASH_ATTENTION_ARCH and CUTE_DSL_ARCH; CUTE_DSL_KEEP_CUBIN leaves the cubins), and
bench/sass.py lists each kernel's loops (its main loop's size and opcodes).

    FA4_PYTHON=/path/to/venv/bin/python python bench/fa4_sass.py fwd 128 [--causal] [--keep DIR]
    python bench/sass.py loops . fwd_bfloat16 wgmma_hd128     # cupyflash's, to compare
    FA4_PYTHON=... python bench/fa4_sass.py fwd 128 --stalls  # its step loops' stalls (`sass.py stalls`)

FA4_PYTHON is a Python with flash-attn-4 and what it imports (nvidia-cutlass-dsl with its cu13
libs, a CPU build of torch, triton, quack-kernels, apache-tvm-ffi<0.2, einops; the versions
../shared/peers/fa4/pack.sh names): not a dependency of cupyflash, nor of this checkout's venv.
On this machine (Python 3.11) such a Python is pyenv's 3.12 with the cp312 torch wheel of the
local index, PYTHONPATH holding `pack.sh`'s wheels unpacked as `install.sh finish` unpacks them.
nvdisasm as bench/sass.py says. Shapes: bf16, batch 4, seqlen 4096, 2048 / headdim heads.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sass  # noqa: E402

COMPILE = """
import sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from flash_attn.cute import interface
pass_, headdim, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
with FakeTensorMode():
    q, k, v, out, dout = (torch.empty(4, 4096, 2048 // headdim, headdim, dtype=torch.bfloat16, device="cuda")
                          for _ in range(5))
    if pass_ == "fwd":
        interface._flash_attn_fwd(q, k, v, causal=causal)
    else:
        lse = torch.empty(4, 2048 // headdim, 4096, dtype=torch.float32, device="cuda")
        interface._flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)
"""
KERNEL = {"fwd": "flash_fwd_sm90", "bwd": "flash_bwd_sm90"}  # (the backward's pre- and postprocess kernels aside)


def compile_fa4(python, pass_, headdim, causal, directory):
    """The cubin of FA4's main kernel for the call, compiled into `directory`."""
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
               CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=str(directory))
    done = subprocess.run([python, "-c", COMPILE, pass_, str(headdim), str(int(causal))], env=env, cwd=directory,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"FA4 did not compile:\n{done.stderr[-3000:]}")
    cubins = [p for p in directory.glob("*.cubin") if KERNEL[pass_] in p.name]
    if len(cubins) != 1:
        raise SystemExit(f"expected one {KERNEL[pass_]} cubin in {directory}, found {[p.name for p in cubins]}")
    return cubins[0]


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pass_", choices=("fwd", "bwd"), metavar="pass")
    parser.add_argument("headdim", type=int)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--keep", type=pathlib.Path, help="leave the cubins in this directory")
    parser.add_argument("--min", type=int, default=60, help="the shortest loop listed, in instructions")
    parser.add_argument("--stalls", action="store_true", help="the step loops' stall cycles, as `sass.py stalls`")
    parser.add_argument("--listing", action="store_true", help="with --stalls: each step instruction")
    args = parser.parse_args(argv)
    python = os.environ.get("FA4_PYTHON")
    if not python:
        raise SystemExit("set FA4_PYTHON to a Python with flash-attn-4 (this file's docstring)")
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.keep or pathlib.Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        cubin = compile_fa4(python, args.pass_, args.headdim, args.causal, directory.resolve())
        lines = sass.listing(cubin)
        print(f"FA4 {args.pass_} hd{args.headdim}{' causal' if args.causal else ''}: "
              f"{len(sass.instructions(lines))} instructions")
        if args.stalls:
            sass.print_stalls(cubin, args.min, args.listing)
            return
        for count, opcodes in sass.loops(lines, args.min):
            print(f"  loop of {count}: " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(14)))


if __name__ == "__main__":
    main(sys.argv[1:])
