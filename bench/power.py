"""Clock and power of the GPU while one implementation's calls run back to back: is a cell held by the
power cap (the H200's 700 W) rather than by its kernel's instructions or latency?

    python bench/power.py                                   # the default runs below
    python bench/power.py cupyflash:fwd:128:1 cudnn:fwd:128:1 cupyflash:fwd:128:0:dropout
    python bench/power.py --dram cupyflash:fwd:128:1 cudnn:fwd:128:1   # and each main kernel's DRAM bytes (ncu)
    python bench/power.py --seqlen 16384 cupyflash:fwd:128:0 fa4:fwd:128:0

A run is impl:pass:headdim:causal[:dropout], impl one of cupyflash, cudnn and flash (PyTorch SDPA's
backends) and fa4 (flash_attn.cute, where flash-attn-4 is installed; no dropout), pass fwd or bwd.
Each runs in a process of its own for RUN_S seconds of 10-call batches between CUDA events while
nvidia-smi samples the SM clock and the board power every 100 ms; a row is the time per call,
TFLOP/s (FLOPs as in ../shared/peers/README.md, at 16384 tokens and hidden 2048, seqlen 4096 unless
--seqlen), and the medians of the samples of the last STEADY_S seconds (the first include compiling
and warming up). A kernel at the cap runs below the top clock (1980 MHz) at 680-700 W, and
there the energy of its work, not its instruction count, sets its speed (bench/notes/v36). With
--dram, ncu also reads the DRAM bytes of one launch of the run's main kernel (NCU_KERNELS; q, k and v
are 64 MiB each, so a forward that reads each once reads ~201 MB).
"""

import json
import statistics
import subprocess
import sys
import time

from cupyflash.benchmark import HIDDEN, TOKENS, attention_flops

SEQLEN = 4096  # unless --seqlen
RUN_S, STEADY_S, SAMPLE_MS = 4.0, 3.0, 100
# ncu's name filter for each implementation's main kernel (not the backward's dot and dq conversion)
NCU_KERNELS = {"cupyflash": "regex:cupyflash_(fwd|bwd)_(bfloat16|float16)", "cudnn": "regex:fprop|bprop",
               "flash": "regex:flash_fwd|flash_bwd", "fa4": "regex:flash_fwd_sm90|flash_bwd_sm90"}
DRAM_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
_UNIT_BYTES = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}
DEFAULT_RUNS = [f"{impl}:{pass_}:{hd}:{causal}" for pass_, hd in (("fwd", 128), ("bwd", 128), ("fwd", 64), ("fwd", 256))
                for causal in (0, 1) for impl in ("cupyflash", "cudnn")] + ["cupyflash:fwd:128:0:dropout"]


def parse_run(text):
    """'impl:pass:headdim:causal[:dropout]' -> (impl, pass, headdim, causal, dropout)."""
    parts = text.split(":")
    if (len(parts) not in (4, 5) or parts[0] not in NCU_KERNELS or parts[1] not in ("fwd", "bwd")
            or not parts[2].isdigit() or HIDDEN % int(parts[2]) or parts[3] not in ("0", "1")
            or parts[4:] not in ([], ["dropout"]) or parts[4:] and parts[0] == "fa4"):
        raise ValueError(f"a run is impl:pass:headdim:causal[:dropout] with impl one of {', '.join(NCU_KERNELS)} (fa4 "
                         f"without dropout), pass fwd or bwd, headdim dividing {HIDDEN} and causal 0 or 1, got {text!r}")
    return parts[0], parts[1], int(parts[2]), parts[3] == "1", len(parts) == 5


def parse_seqlen(text):
    """--seqlen's value: a whole number dividing the TOKENS."""
    if not text.isdigit() or not 0 < int(text) <= TOKENS or TOKENS % int(text):
        raise ValueError(f"--seqlen takes a whole number dividing {TOKENS}, got {text!r}")
    return int(text)


def steady_medians(lines, samples):
    """Medians (MHz, W) of the last `samples` of nvidia-smi's 'clock, power' lines."""
    values = [tuple(float(x) for x in line.split(",")) for line in lines if line.count(",") == 1]
    values = values[-samples:]
    if not values:
        raise RuntimeError("nvidia-smi gave no samples")
    return statistics.median(c for c, _ in values), statistics.median(p for _, p in values)


def ncu_bytes(report):
    """{metric: bytes} of DRAM_METRICS in ncu's printed report (the last launch's, where several)."""
    found = {}
    for line in report.splitlines():
        words = line.split()
        if len(words) == 3 and words[0] in DRAM_METRICS and words[1] in _UNIT_BYTES:
            found[words[0]] = float(words[2].replace(",", "")) * _UNIT_BYTES[words[1]]
    return found


def dram_bytes(text, seqlen):
    """(read, written) bytes of one launch of `text`'s main kernel, by ncu, or None where it fails."""
    impl = parse_run(text)[0]
    done = subprocess.run(["ncu", "-k", NCU_KERNELS[impl], "--launch-skip", "5", "--launch-count", "1",
                           "--metrics", ",".join(DRAM_METRICS), sys.executable, __file__, "--worker", text, str(seqlen),
                           "--short"],
                          capture_output=True, text=True)
    found = ncu_bytes(done.stdout)
    return None if done.returncode or len(found) < len(DRAM_METRICS) else tuple(found[m] for m in DRAM_METRICS)


def worker(text, seqlen, short=False):
    """Runs `text`'s calls for RUN_S seconds (short: 10 calls, for ncu); prints {"ms": per call,
    "tflops": ...} as JSON."""
    impl, pass_, hd, causal, dropout = parse_run(text)
    batch, nheads = TOKENS // seqlen, HIDDEN // hd
    flops = attention_flops(batch, nheads, seqlen, hd, causal, pass_)
    if impl == "cupyflash":
        import cupy
        from cupyflash import flash_attn_backward, flash_attn_func
        from cupyflash._arrays import bfloat16_dtype
        options = dict(dropout_p=0.1, seed=1) if dropout else {}
        q, k, v, dout = (cupy.random.standard_normal((batch, seqlen, nheads, hd), dtype=cupy.float32)
                         .astype(bfloat16_dtype()) for _ in range(4))
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, **options)
        call = ((lambda: flash_attn_func(q, k, v, causal=causal, **options)) if pass_ == "fwd"
                else (lambda: flash_attn_backward(dout, q, k, v, out, lse, causal=causal, **options)))
        new_event, elapsed_ms = cupy.cuda.Event, cupy.cuda.get_elapsed_time
    else:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if impl == "fa4":  # (batch, seqlen, heads, headdim) tensors
            from flash_attn.cute import flash_attn_func as fa4
            shape = (batch, seqlen, nheads, hd)
        else:
            backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[impl]
            shape = (batch, nheads, seqlen, hd)
        q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(4))
        dropout_p = 0.1 if dropout else 0.0

        def forward():
            if impl == "fa4":
                result = fa4(q, k, v, causal=causal)
                return result[0] if isinstance(result, tuple) else result
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
        out = forward()
        call = forward if pass_ == "fwd" else (lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        new_event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        elapsed_ms = lambda start, end: start.elapsed_time(end)  # noqa: E731
    for _ in range(5):
        call()
    start, end = new_event(), new_event()
    calls, began = 0, time.time()
    start.record()
    while time.time() - began < RUN_S and not (short and calls):
        for _ in range(10):
            call()
        calls += 10
        end.record()
        end.synchronize()
    ms = elapsed_ms(start, end) / calls
    print(json.dumps({"ms": ms, "tflops": flops / ms / 1e9}))


def main(argv):
    if argv[:1] == ["--worker"]:
        return worker(argv[1], int(argv[2]), short=argv[3:] == ["--short"])
    dram = "--dram" in argv
    argv = [a for a in argv if a != "--dram"]
    seqlen = SEQLEN
    if "--seqlen" in argv:
        at = argv.index("--seqlen")
        seqlen = parse_seqlen(argv[at + 1] if at + 1 < len(argv) else "")
        argv = argv[:at] + argv[at + 2:]
    runs = argv or DEFAULT_RUNS
    for text in runs:
        parse_run(text)
    print(f"seqlen {seqlen}, {TOKENS} tokens, hidden {HIDDEN}, bf16; medians of the last {STEADY_S:.0f} s of samples")
    print(f"{'run':34}{'ms':>9}{'TFLOP/s':>9}{'MHz':>7}{'W':>7}" + (f"{'DRAM read MB':>14}{'written MB':>12}" if dram else ""))
    for text in runs:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, text=True)
        done = subprocess.run([sys.executable, __file__, "--worker", text, str(seqlen)], capture_output=True, text=True)
        smi.terminate()
        lines = smi.communicate()[0].splitlines()
        if done.returncode:
            print(f"{text:34} failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        mhz, watts = steady_medians(lines, int(STEADY_S * 1000 / SAMPLE_MS))
        row = f"{text:34}{result['ms']:9.4f}{result['tflops']:9.1f}{mhz:7.0f}{watts:7.0f}"
        if dram:
            moved = dram_bytes(text, seqlen)
            row += f"{moved[0] / 1e6:14.1f}{moved[1] / 1e6:12.1f}" if moved else f"{'ncu failed':>26}"
        print(row, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
