// Thin wrappers over PTX instructions (sm_80 and newer), for any kernel family.
// No CUDA headers are included anywhere, so NVRTC compiles these sources on a machine with
// no CUDA toolkit at all; 16-bit floats travel as raw bits (uint16 / packed pairs in uint32).
#pragma once

typedef unsigned short uint16;
typedef unsigned int uint32;

__device__ __forceinline__ uint32 smem_address(const void* ptr) {
    return static_cast<uint32>(__cvta_generic_to_shared(ptr));
}

// Programmatic dependent launch (sm_90 and newer; no-ops below). A kernel launched with it
// (_plan._Launch.dependent) may start while the kernel before it in the stream still runs, once
// every block of that one has called allow_dependent_grid (or exited): it waits in
// wait_for_prior_grid, before its first global read, until that kernel has finished and its writes
// are visible (at once when it was launched without). Its launch and block placement then overlap
// the tail of the kernel before.
__device__ __forceinline__ void wait_for_prior_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// A thread-block cluster's (sm_90): every thread of its CTAs meets here, and the shared-memory
// writes of each before it are seen by the reads of any after it.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// A word (or four) of the shared memory of the cluster's CTA `rank`, at the address `address` has
// in this CTA's.
__device__ __forceinline__ float ld_cluster_f32(uint32 address, int rank) {
    float value = 0.f;
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %1, %2;\nld.shared::cluster.f32 %0, [remote];\n}\n"
                 : "=f"(value) : "r"(address), "r"(rank) : "memory");
#endif
    return value;
}
__device__ __forceinline__ float4 ld_cluster_f32x4(uint32 address, int rank) {
    float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %4, %5;\n"
                 "ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [remote];\n}\n"
                 : "=f"(value.x), "=f"(value.y), "=f"(value.z), "=f"(value.w) : "r"(address), "r"(rank) : "memory");
#endif
    return value;
}

// Bits [first, first + width) set, none past bit 31 (bmsk.clamp: first >= 32 gives 0, a width
// past the top is cut there).
__device__ __forceinline__ uint32 bit_run(uint32 first, uint32 width) {
    uint32 bits;
    asm("bmsk.clamp.b32 %0, %1, %2;\n" : "=r"(bits) : "r"(first), "r"(width));
    return bits;
}

// A 32-bit word of shared memory by its shared address (plus OFFSET, an immediate of the store;
// volatile: a value another thread wrote before a barrier that this one has since waited on).
template <int OFFSET = 0>
__device__ __forceinline__ void st_shared_u32(uint32 address, uint32 value) {
    asm volatile("st.shared.u32 [%0+%2], %1;\n" :: "r"(address), "r"(value), "n"(OFFSET) : "memory");
}
__device__ __forceinline__ uint32 ld_shared_u32(uint32 address) {
    uint32 value;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(value) : "r"(address) : "memory");
    return value;
}
__device__ __forceinline__ uint4 ld_shared_u128(uint32 address) {
    uint4 value;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w) : "r"(address) : "memory");
    return value;
}
__device__ __forceinline__ void st_global_u128(void* address, uint4 value) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n"
                 :: "l"(address), "r"(value.x), "r"(value.y), "r"(value.z), "r"(value.w) : "memory");
}
// The store where `store` holds, predicated: no branch, so that the addresses of a run of them are
// computed together (under a branch each, ptxas derives each from the last's).
__device__ __forceinline__ void st_global_u128_if(bool store, void* address, uint4 value) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n"
                 :: "l"(address), "r"(value.x), "r"(value.y), "r"(value.z), "r"(value.w), "r"(int(store)) : "memory");
}

// 16-byte asynchronous global -> shared copy. When `valid` is false nothing is read and the
// 16 bytes are zero-filled, which is how tiles are padded past the end of a sequence or head.
__device__ __forceinline__ void cp_async_16(uint32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// The same for one 4-byte word (row statistics such as lse, whose rows need not be 16-byte aligned).
__device__ __forceinline__ void cp_async_4(uint32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// Four 8x8 matrices of 16-bit elements; lane i gives the address of row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32 (&r)[4], uint32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32 (&r)[2], uint32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32 (&r)[2], uint32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32 (&r)[4], uint32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// The reverse of ldmatrix (sm_90): each lane gives the address of one row of the 8x8 matrices
// and holds its fragment pieces as ldmatrix would have returned them.
__device__ __forceinline__ void stmatrix_x4(uint32 addr, uint32 r0, uint32 r1, uint32 r2, uint32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
__device__ __forceinline__ void stmatrix_x2(uint32 addr, uint32 r0, uint32 r1) {
    asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};\n" :: "r"(addr), "r"(r0), "r"(r1) : "memory");
}

// d (16x8 fp32) += a (16x16) * b (16x8), 16-bit inputs.
template <bool BF16>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32 (&a)[4], uint32 b0, uint32 b1) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two floats -> one packed pair of 16-bit floats (round to nearest even); `lo` in the low half.
template <bool BF16>
__device__ __forceinline__ uint32 pack_pair(float lo, float hi) {
    uint32 r;
    if (BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    else      asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <bool BF16>
__device__ __forceinline__ uint16 to_16bit(float x) {
    return static_cast<uint16>(pack_pair<BF16>(x, 0.f) & 0xffffu);
}

template <bool BF16>
__device__ __forceinline__ float to_float(uint16 x) {
    if (BF16) return __uint_as_float(static_cast<uint32>(x) << 16);
    float f;
    asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }\n" : "=f"(f) : "h"(x));
    return f;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// *address += (a, b) on two adjacent fp32 words in global memory (8-byte aligned), without a
// return value. sm_90 has a vector reduction, which halves the atomic instructions.
__device__ __forceinline__ void atomic_add_pair(float* address, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(address), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(address, a);
    atomicAdd(address + 1, b);
#endif
}

// A GPU-scope flag: the load sees every write made before the matching release add.
__device__ __forceinline__ int load_acquire(const int* address) {
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(address) : "memory");
    return value;
}
// Orders the CTA's earlier writes (made visible to this thread by a barrier) before the add.
__device__ __forceinline__ void add_release(int* address, int value) {
    asm volatile("fence.acq_rel.gpu;\nred.release.gpu.global.add.s32 [%0], %1;\n" :: "l"(address), "r"(value) : "memory");
}

// Adds to a GPU-scope counter and returns its old value: the CTA's earlier writes (made visible to
// this thread by a barrier) are ordered before the add, and later reads see what the writers that
// added before had ordered before theirs.
__device__ __forceinline__ int add_acq_rel(int* address, int value) {
    int old;
    asm volatile("fence.acq_rel.gpu;\natom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n"
                 : "=r"(old) : "l"(address), "r"(value) : "memory");
    return old;
}

// x, as a value the compiler cannot see through: what is derived from it again (say a tile's
// head, batch and sequence after its key loop) is recomputed where it is used, not held in
// registers through a loop that has none to spare.
__device__ __forceinline__ int recomputed(int x) {
    asm volatile("" : "+r"(x));
    return x;
}
