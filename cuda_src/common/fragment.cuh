// Accumulator fragments in registers, the layout both tensor-core instructions give: mma.sync's
// m16n8 C fragment, which wgmma (sm90/) repeats over its N / 8 column blocks for each warp's 16
// rows. A fragment acc[mt][nt][4] covers rows 16*mt + {g, g+8} and columns 8*nt + 2*t + {0, 1},
// where g = lane / 4 and t = lane % 4; elements 0,1 are row g and elements 2,3 are row g + 8.
#pragma once

// A compile-time value passed as an argument, for generic lambdas: f(Constant<a>()) and
// f(Constant<b>()) are two instantiations, each with `decltype(arg)::value` a constant.
template <auto V>
struct Constant {
    static constexpr auto value = V;
    __device__ constexpr operator decltype(V)() const { return V; }
};

// Calls f(Constant<0>()), ..., f(Constant<N - 1>()): a loop whose index is a compile-time
// constant in the body (an asm immediate, a template argument).
template <int N, typename F>
__device__ __forceinline__ void static_for(F f) {
    if constexpr (N > 0) {
        static_for<N - 1>(f);
        f(Constant<N - 1>());
    }
}

// Calls f(mt, nt, e) for every element of an accumulator fragment [MT][NT][4], fully unrolled, so
// after inlining mt, nt and e are constants and every fragment index is a register, not memory.
template <int MT, int NT, typename F>
__device__ __forceinline__ void for_each_element(F f) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) f(mt, nt, e);
}

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
    for_each_element<MT, NT>([&](int mt, int nt, int e) { acc[mt][nt][e] = 0.f; });
}

// Maps an accumulator element to its (row, col) inside the warp tile.
__device__ __forceinline__ int fragment_row(int mt, int e) { return 16 * mt + (threadIdx.x % 32) / 4 + 8 * (e / 2); }
__device__ __forceinline__ int fragment_col(int nt, int e) { return 8 * nt + 2 * (threadIdx.x % 4) + (e % 2); }
