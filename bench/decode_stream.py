"""Does the decode's access pattern cost DRAM bandwidth (issue 21)? v66's H100 grid has single-row
decode 2.4% behind cuDNN at every length, most on hd64 with several kv heads, whose 128-byte key
rows sit 1-4 KB apart (a CTA per (split, kv head, batch entry) reads one head's rows), and the L2's
256-byte fetches made it worse (v66). This streams a (batch, seqlen, heads, 64) bf16 tensor (the
K cache's layout) with no attention, summing it, four ways, and prints TB/s (median of 9 CUDA-event
timings after one warm-up):

  per_head:  a CTA per (row split, head, batch entry) reads its head's 128-byte rows: the decode's
             pattern (8 warps, each 16 rows a step, warps interleaved by block as the decode's);
  heads_by_warp: a CTA per (row split, 8 heads, batch entry), each warp one head's rows of the
             CTA's keys (heads a multiple of 8), as many CTAs and bytes;
  all_heads: a CTA per (row split, batch entry) reads whole rows of every head (heads x 128 bytes
             contiguous), as many CTAs and bytes;
  contiguous: the same bytes as one flat array, CTAs over consecutive chunks (the copy's pattern);
each at two CTAs an SM (as the decode's dense hd64 tile runs) and, marked *, as many as fit.

Usage (GPU): python bench/decode_stream.py [batch seqlen heads ...]  (default: the v66 grid's worst
hd64 cells, 64 x 131072 x 8, 16 x 131072 x 32, 128 x 65536 x 8, and MQA 128 x 131072 x 1).
`--spans [batch seqlen heads headdim ...]`: per_head's steps with a row of 1, 2, 4, ... heads' rows
read together (spans()).
"""
import statistics
import sys

import cupy

SOURCE = r"""
extern "C" __global__ void heads_by_warp(const uint4* k, int seqlen, int heads, int rows_per_cta, float* out) {
    // grid (splits, heads / 8, batch), 8 warps: warp w reads head 8 * blockIdx.y + w's rows, 16 a step,
    // so that the CTA reads 8 heads' rows of the same keys together
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = blockIdx.x * rows_per_cta, h = blockIdx.y * 8 + warp, b = blockIdx.z;
    const int row_in_step = lane / 8, chunk = lane % 8;
    float acc = 0.f;
    for (int step = 0; step * 16 < rows_per_cta; ++step) {
        uint4 x[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = r0 + step * 16 + 4 * i + row_in_step;
            x[i] = __ldg(k + ((static_cast<long long>(b) * seqlen + r) * heads + h) * 8 + chunk);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) acc += __int_as_float(x[i].x ^ x[i].y ^ x[i].z ^ x[i].w);
    }
    if (acc == 1.2345f) out[0] = acc;
}
extern "C" __global__ void spans(const uint4* k, int seqlen, int heads, int head_chunks, int span, int rows_per_cta,
                                  float* out) {
    // grid (splits, heads / span, batch), 8 warps taking 16-row steps in turn, as the decode's; a row
    // is `span` heads' 16-byte chunks, contiguous: span 1 is per_head, span = heads whole rows
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = blockIdx.x * rows_per_cta, h0 = blockIdx.y * span, b = blockIdx.z;
    const int row_chunks = span * head_chunks, step_chunks = 16 * row_chunks;  // (a multiple of 128)
    float acc = 0.f;
    for (int step = warp; step * 16 < rows_per_cta; step += blockDim.x / 32) {
        for (int c0 = 0; c0 < step_chunks; c0 += 128) {  // four 16-byte loads a lane in flight
            uint4 x[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int c = c0 + lane + 32 * i, r = r0 + step * 16 + c / row_chunks;
                x[i] = __ldg(k + ((static_cast<long long>(b) * seqlen + r) * heads + h0) * head_chunks + c % row_chunks);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) acc += __int_as_float(x[i].x ^ x[i].y ^ x[i].z ^ x[i].w);
        }
    }
    if (acc == 1.2345f) out[0] = acc;
}
extern "C" __global__ void all_heads(const uint4* k, int seqlen, int heads, int rows_per_cta, float* out) {
    // grid (splits, 1, batch): rows_per_cta rows of every head, heads x 8 uint4 contiguous a row
    const long long base = (static_cast<long long>(blockIdx.z) * seqlen + blockIdx.x * rows_per_cta) * heads * 8;
    const long long count = static_cast<long long>(rows_per_cta) * heads * 8;
    float acc = 0.f;
    for (long long i = threadIdx.x; i < count; i += 4 * blockDim.x) {
        uint4 x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = i + j * blockDim.x < count ? __ldg(k + base + i + j * blockDim.x) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc += __int_as_float(x[j].x ^ x[j].y ^ x[j].z ^ x[j].w);
    }
    if (acc == 1.2345f) out[0] = acc;
}
"""


DECODE_SMEM = 100 * 1024  # the dense hd64 decode tile's before v67, (16 + 2 x 3 x 16 x 8) rows of 128 bytes
ONE_CTA_SMEM = 150 * 1024  # more than half an SM's: one CTA an SM, as the dense decode tiles run since v67


def timed_tbps(launch, nbytes):
    launch()
    times = []
    for _ in range(9):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return nbytes / (statistics.median(times) * 1e-3) / 1e12


def spans(argv):
    """--spans [batch seqlen heads headdim ...]: a row of `span` heads' rows, contiguous, per CTA
    (span 1: the decode's pattern), at one CTA an SM (the decode's dense tiles since v67) and at as
    many as fit (*): how many heads' rows must one CTA read together to stream as whole rows do?"""
    cells = [tuple(map(int, argv[i:i + 4])) for i in range(0, len(argv), 4)] or [
        (64, 131072, 8, 64), (16, 131072, 32, 64), (64, 65536, 8, 128), (16, 65536, 32, 128)]
    function = cupy.RawModule(code=SOURCE).get_function("spans")
    function.max_dynamic_shared_size_bytes = ONE_CTA_SMEM
    out = cupy.zeros(1, cupy.float32)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: TB/s read (bf16) by heads read together a "
          f"row, at one CTA an SM and (*) as many as fit")
    for batch, seqlen, heads, headdim in cells:
        k = cupy.empty((batch * seqlen * heads * headdim * 2 // 16, 4), dtype=cupy.uint32)
        line = []
        for smem in (ONE_CTA_SMEM, 0):
            span = 1
            while span <= heads:
                units = heads // span * batch
                splits = 1 << max(0, -(-(1 if smem else 8) * sms // units) - 1).bit_length()
                args = (k, cupy.int32(seqlen), cupy.int32(heads), cupy.int32(headdim // 8), cupy.int32(span),
                        cupy.int32(seqlen // splits), out)
                rate = timed_tbps(lambda: function((splits, heads // span, batch), (256,), args, shared_mem=smem),
                                  k.nbytes)
                line.append(f"{span}{'' if smem else '*'} {rate:.2f}")
                span *= 2
        print(f"{batch} x {seqlen} x {heads} x hd{headdim}: span " + "  ".join(line), flush=True)
        del k


def main(argv):
    if argv[:1] == ["--spans"]:
        return spans(argv[1:])
    cells = [tuple(map(int, argv[i:i + 3])) for i in range(0, len(argv), 3)] or [
        (64, 131072, 8), (16, 131072, 32), (128, 65536, 8), (128, 131072, 1)]
    module = cupy.RawModule(code=SOURCE)
    per_head, all_heads = module.get_function("spans"), module.get_function("all_heads")  # (per_head: span 1)
    heads_by_warp = module.get_function("heads_by_warp")
    out = cupy.zeros(1, cupy.float32)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: TB/s read (bf16, head dim 64); "
          f"each cell at two CTAs an SM (the decode's dense hd64 tile: 100 KB of shared memory each) and at as "
          f"many as fit (no shared memory)")
    for function in (per_head, all_heads, heads_by_warp):
        function.max_dynamic_shared_size_bytes = DECODE_SMEM
    for batch, seqlen, heads in cells:
        k = cupy.empty((batch * seqlen * heads * 64 * 2 // 16, 4), dtype=cupy.uint32)  # 16-byte chunks
        nbytes = k.nbytes
        line = []
        units = heads * batch  # the decode's CTAs: one per (split, head, batch entry)
        for smem in (DECODE_SMEM, 0):
            # about a wave of CTAs (or more), a power of two so that every row is read
            splits = 1 << max(0, -(-(2 if smem else 8) * sms // units) - 1).bit_length()
            rows = seqlen // splits
            args = (k, cupy.int32(seqlen), cupy.int32(heads), cupy.int32(8), cupy.int32(1), cupy.int32(rows), out)
            line.append(f"per_head/{splits}{'' if smem else '*'} "
                        f"{timed_tbps(lambda: per_head((splits, heads, batch), (256,), args, shared_mem=smem), nbytes):.2f}")
            if heads % 8 == 0:  # as many CTAs and bytes, each CTA an eighth of the rows of 8 heads
                args = (k, cupy.int32(seqlen), cupy.int32(heads), cupy.int32(rows // 8), out)
                rate = timed_tbps(lambda: heads_by_warp((splits * 8, heads // 8, batch), (256,), args, shared_mem=smem),
                                  nbytes)
                line.append(f"heads_by_warp/{splits * 8}{'' if smem else '*'} {rate:.2f}")
            # as many CTAs and bytes, each CTA a heads-th of the rows of every head
            args = (k, cupy.int32(seqlen), cupy.int32(heads), cupy.int32(rows // heads), out)
            line.append(f"all_heads/{splits * heads}{'' if smem else '*'} "
                        f"{timed_tbps(lambda: all_heads((splits * heads, 1, batch), (256,), args, shared_mem=smem), nbytes):.2f}")
        flat = (k, cupy.int32(batch * seqlen), cupy.int32(heads), cupy.int32(seqlen // 8), out)
        line.append(f"contiguous* {timed_tbps(lambda: all_heads((batch * 8, 1, 1), (256,), flat), nbytes):.2f}")
        print(f"{batch} x {seqlen} x {heads}: " + "  ".join(line), flush=True)
        del k


if __name__ == "__main__":
    main(sys.argv[1:])
