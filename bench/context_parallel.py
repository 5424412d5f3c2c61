"""Context parallelism's weak scaling: causal attention (bf16, hd128, 16 heads, batch 1) forward and
backward over a sequence sharded across the GPUs of one host, per-GPU TFLOP/s of
cupyflash.torch.ring_flash_attn_func (zigzag) against single-GPU cupyflash at the same per-GPU slice,
and PyTorch's own context parallel attention where it runs.

    torchrun --nproc-per-node N bench/context_parallel.py [--tokens 131072 262144 524288 1048576]

FLOPs as in ../shared/peers/README.md: 4 b h s^2 d for the forward, halved when causal, the backward
2.5x that; a GPU's share of the ring is 1/N of the sequence's, and the single-GPU baseline counts its
own slice's. Times: CUDA events around fwd+bwd, warm-up excluded, median of --reps, every rank timed
and the slowest reported. Writes context_parallel.md (rank 0). `--device cpu` runs the plumbing over
gloo on tiny sizes (the tests do).
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import cupyflash.torch as cft

HEADS, HEADDIM = 16, 128


def flops(seqlen, causal=True):
    forward = 4 * HEADS * seqlen * seqlen * HEADDIM / (2 if causal else 1)
    return 3.5 * forward  # forward + backward (2.5x)


def _timed(step, device, reps):
    """Median seconds of step() (fwd+bwd), warm-up excluded; CUDA events on the GPU."""
    step()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _inputs(seqlen, device, dtype):
    generator = torch.Generator(device).manual_seed(seqlen)
    return [torch.randn(1, seqlen, HEADS, HEADDIM, device=device, dtype=dtype, generator=generator).requires_grad_()
            for _ in range(3)]


def _fwd_bwd(attention, q, k, v):
    def step():
        for x in (q, k, v):
            x.grad = None
        attention(q, k, v).sum().backward()
    return step


def _torch_context_parallel(tokens, world, device, dtype, reps):
    """PyTorch's context parallel SDPA over the same sequence (seconds), or the reason it does not run."""
    try:
        if device != "cuda":  # (trying leaves its mesh's threads to abort the process at exit)
            raise NotImplementedError("PyTorch's context parallel SDPA has no CPU kernel")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        import torch.nn.functional as F
        mesh = init_device_mesh(device, (world,))
        q, k, v = (x.detach().transpose(1, 2).contiguous() for x in _inputs(tokens, device, dtype))

        def step():  # (the context shards its buffers in place: leaves with gradients are taken inside)
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()
        return _timed(step, device, reps)
    except Exception as error:  # a missing or failing peer gives a blank cell with its reason
        return f"{type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''}"


def run(rank, world, init_method, tokens_list, reps, device, out_dir):
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    rows = []
    try:
        for tokens in tokens_list:
            local = [cft.shard_sequence(x.detach(), layout="zigzag").requires_grad_()
                     for x in _inputs(tokens, device, dtype)]
            ring = _timed(_fwd_bwd(lambda q, k, v: cft.ring_flash_attn_func(q, k, v, causal=True), *local),
                          device, reps)
            single = _timed(_fwd_bwd(lambda q, k, v: cft.flash_attn_func(q, k, v, causal=True),
                                     *_inputs(tokens // world, device, dtype)), device, reps)
            peer = _torch_context_parallel(tokens, world, device, dtype, reps)
            every = [None] * world
            dist.all_gather_object(every, (ring, single, peer))  # the slowest rank's times count
            peers = [r[2] for r in every]
            peer = max(peers) if all(isinstance(p, float) for p in peers) else \
                next(p for p in peers if not isinstance(p, float))
            rows.append((tokens, max(r[0] for r in every), max(r[1] for r in every), peer))
        if rank == 0:
            lines = [f"# Context parallelism: weak scaling over {world} {device} devices", "",
                     f"causal, zigzag, batch 1, {HEADS} heads, hd{HEADDIM}, {dtype}; fwd+bwd; per-GPU TFLOP/s "
                     "(the ring's share: 1/N of the sequence's FLOPs); single GPU at the same slice length.", "",
                     "| tokens | per GPU | ring ms | ring TFLOP/s/GPU | single-GPU TFLOP/s | efficiency | "
                     "PyTorch CP TFLOP/s/GPU |", "|---|---|---|---|---|---|---|"]
            for tokens, ring, single, peer in rows:
                per_gpu = flops(tokens) / world / ring / 1e12
                alone = flops(tokens // world) / single / 1e12
                peer_text = f"{flops(tokens) / world / peer / 1e12:.4g}" if isinstance(peer, float) else peer
                lines.append(f"| {tokens} | {tokens // world} | {ring * 1e3:.4g} | {per_gpu:.4g} | {alone:.4g} | "
                             f"{per_gpu / alone:.3f} | {peer_text} |")
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "context_parallel.md"), "w") as f:
                f.write("\n".join(lines) + "\n")
            print("\n".join(lines))
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args.tokens, args.reps, args.device,
        args.out)


if __name__ == "__main__":
    main()
