// Shared definitions for gear's CUDA kernels.
//
// Compiled by NVRTC (through CuPy) and by nvcc (`make kernels-build`), so this
// file includes no system header: fixed-width types are spelled out here.
#pragma once

typedef unsigned char u8;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

// Counter-based random numbers: the splitmix64 output function applied to
// state = mix(seed) + (counter + 1) * golden. kernels/rng.py computes the same
// values in NumPy, so a draw depends only on (seed, counter), never on the
// thread that makes it.
#define GEAR_GOLDEN 0x9E3779B97F4A7C15ULL

__device__ __forceinline__ u64 gear_mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// `seed_state` is gear_mix64(seed) computed once on the host (rng.seed_state).
__device__ __forceinline__ u64 gear_random_u64(u64 seed_state, u64 counter) {
    return gear_mix64(seed_state + (counter + 1ULL) * GEAR_GOLDEN);
}

// A double in [0, 1) from the top 53 bits.
__device__ __forceinline__ double gear_random_unit(u64 seed_state, u64 counter) {
    return (double)(gear_random_u64(seed_state, counter) >> 11) * 1.1102230246251565e-16;  // 2^-53
}
