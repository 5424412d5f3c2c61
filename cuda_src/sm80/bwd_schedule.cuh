// The backward's scheduling, apart from its math: which CTA walks which query steps (TailSplit),
// the deterministic order of dQ's adds (wait_dq_turn, pass_dq_turn) and which thread moves which
// row in the row kernels (RowKernel).
#pragma once
#include "../common/mask.cuh"
#include "../common/params.cuh"
#include "../common/ptx.cuh"

// The plain backward's last partial wave. Every CTA walks all the query steps of its key block,
// so the grid's last (CTAs mod resident CTAs) would run on a few SMs while the others idle;
// interface._tail_split may give each of its last p.tail_units CTAs (in launch order) to
// p.tail_parts pieces instead: CTAs of z slices past the batch, each walking a share of the steps.
// A piece adds its dK and dV into dkv_accum; the last of a key block's pieces to finish reads the
// sums back and stores them as an ordinary CTA does.
struct TailSplit {
    GridSlot slot;
    int unit;   // the key block's index among the split ones; -1 for an ordinary CTA
    int part;
    bool idle;  // a split CTA of the ordinary grid, or past the last piece

    __device__ __forceinline__ TailSplit(const FlashParams& p, GridSlot grid_slot, bool may_split)
        : slot(grid_slot), unit(-1), part(0), idle(false) {
        if (!may_split || p.tail_units == 0) return;
        const int per_batch = gridDim.x * gridDim.y;
        const int units = p.batch * per_batch;
        const int id = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;  // launch order
        if (id < units - p.tail_units) return;
        const int piece = id - units;
        idle = piece < 0 || piece >= p.tail_units * p.tail_parts;
        if (idle) return;
        unit = piece / p.tail_parts;
        part = piece - unit * p.tail_parts;
        const int split = units - p.tail_units + unit;
        slot.block = split % gridDim.x;
        slot.head = split / gridDim.x % gridDim.y;
        slot.batch = split / per_batch;
    }

    // This piece's share [first, first + count) of `steps` steps.
    __device__ __forceinline__ int first(int steps, const FlashParams& p) const { return part * steps / p.tail_parts; }
    __device__ __forceinline__ int count(int steps, const FlashParams& p) const {
        return (part + 1) * steps / p.tail_parts - first(steps, p);
    }

    // Adds the piece's dK and dV (a CTA's fragments, `elements` = BLOCK_N x HEADDIM each) into the
    // sums. Returns false but in the key block's last piece, which gets the sums in `dk` and `dv`.
    // The sums are in fragment order: one reduction of a warp adds 256 contiguous bytes.
    template <int MT, int NT>
    __device__ __forceinline__ bool gather(const FlashParams& p, float (&dk)[MT][NT][4], float (&dv)[MT][NT][4],
                                           int elements) const {
        float* sums = p.dkv_accum + 2LL * unit * elements + threadIdx.x / 32 * (MT * NT * 128) + threadIdx.x % 32 * 2;
#pragma unroll
        for (int i = 0; i < MT * NT * 2; ++i) {
            const int mt = i / (NT * 2), nt = i / 2 % NT, half = i % 2;
            atomic_add_pair(sums + 64 * i, dk[mt][nt][2 * half], dk[mt][nt][2 * half + 1]);
            atomic_add_pair(sums + elements + 64 * i, dv[mt][nt][2 * half], dv[mt][nt][2 * half + 1]);
        }
        __syncthreads();  // every thread's adds are issued before the count
        if (!__syncthreads_or(threadIdx.x == 0 && add_acq_rel(p.tail_pieces_done + unit, 1) == p.tail_parts - 1))
            return false;
#pragma unroll
        for (int i = 0; i < MT * NT * 2; ++i) {
            const int mt = i / (NT * 2), nt = i / 2 % NT, half = i % 2;
            const float2 k_sum = __ldcg(reinterpret_cast<const float2*>(sums + 64 * i));
            const float2 v_sum = __ldcg(reinterpret_cast<const float2*>(sums + elements + 64 * i));
            dk[mt][nt][2 * half] = k_sum.x;
            dk[mt][nt][2 * half + 1] = k_sum.y;
            dv[mt][nt][2 * half] = v_sum.x;
            dv[mt][nt][2 * half + 1] = v_sum.y;
        }
        return true;
    }
};

// The DETERMINISTIC kernels: the key blocks that a query block sees add their dQ in key-block
// order. Each waits on the query block's semaphore for its turn (its index among those key blocks),
// then passes the turn on; the CTAs of earlier key blocks started earlier, so none waits on a later one.
__device__ __forceinline__ int* wait_dq_turn(const FlashParams& p, int batch, int head, int q_block, int turn) {
    int* semaphore = dq_turn_counter(p, batch, head, q_block);
    if (threadIdx.x == 0)
        while (load_acquire(semaphore) != turn) {}
    __syncthreads();
    return semaphore;
}
__device__ __forceinline__ void pass_dq_turn(int* semaphore) {
    __syncthreads();  // every thread's adds are issued before the next key block's turn
    if (threadIdx.x == 0) add_release(semaphore, 1);
}

// The two small kernels cover kRows query rows of one head per block. A row's 16-byte chunks (8
// columns each) go to `lanes` consecutive threads, the power of two at or above headdim_padded / 8,
// so every lane of a warp has a chunk to move at any head dim (with one warp per row, a head dim of
// 64 would leave 24 of 32 lanes idle and the kernels at half FA2's bandwidth).
struct RowKernel {
    static constexpr int kThreads = 256, kRows = 64;
    int lanes, row0;
    __device__ __forceinline__ explicit RowKernel(const FlashParams& p) : lanes(4), row0(blockIdx.x * kRows) {
        while (8 * lanes < p.headdim_padded) lanes *= 2;
    }
    // This thread's first row and its column; the rows advance by kThreads / lanes, the same
    // number of times in every thread (so a row's lanes can shuffle).
    __device__ __forceinline__ int first_row() const { return row0 + threadIdx.x / lanes; }
    __device__ __forceinline__ int rows_per_step() const { return kThreads / lanes; }
    __device__ __forceinline__ int col() const { return threadIdx.x % lanes * 8; }
};
