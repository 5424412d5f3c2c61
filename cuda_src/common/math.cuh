// Constants and integer helpers for every kernel family.
#pragma once

#define CUPYFLASH_INF __int_as_float(0x7f800000)
#define CUPYFLASH_LOG2E 1.4426950408889634f

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
