// What the grouped expert GEMMs share (ds4/kernels/grouped.cu on mma.sync, grouped_wg.cu on
// wgmma): the 128-column stage, bf16 rounding, cp.async copies, the FP4 / FP8 decoders into
// bf16 words with the scale folded in, where an expert's weights are, and the clamped SwiGLU.
// grouped.cu's opening comment says how the codes decode and why.
#pragma once

#include "common.cuh"

typedef unsigned char u8;
typedef unsigned int u32;

constexpr int BK = 128;  // columns per pipeline stage

__device__ __forceinline__ unsigned short round_bf16(float v) {
    u32 b = __float_as_uint(v);
    return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);  // nearest, ties to even
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared; valid false writes zeros (and reads nothing).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n"); }

template <int N>
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// FP4: a lane's 32 columns of a weight row are one 16-byte chunk and one scale. N = n8 tiles
// per warp.
template <int N>
struct Fp4T {
    static constexpr int ROW_BYTES = 64;  // per stage
    static constexpr int WORDS = 4;  // u32 codes a lane holds per weight row and stage
    static constexpr int NT = N;
    // E8M0 byte s -> the bf16x2 factor 2^(s - 127) * 2^126 (both halves).
    __device__ static u32 factor(u32 s) { u32 f = (s + 126u) << 7; return f | (f << 16); }
    // Shared-memory offset of chunk c of a stage row n (no swizzle needed: 4 chunks per row).
    __device__ static int chunk_at(int n, int c) { return n * ROW_BYTES + c * 16; }
    __device__ static int chunk_cols() { return 32; }
    // The two k pairs of step (j, h) from the lane's words.
    __device__ static void decode(const u32* q, int j, int h, u32& b0, u32& b1) {
        e2m1_pairs(q[j], h, b0, b1);  // (common.cuh)
    }
};

// FP8: a lane's 32 columns are two 16-byte chunks (words 0-3 and 4-7), each in one scale block
// (blocks of at least 16 columns).
struct Fp8 {
    static constexpr int ROW_BYTES = 128;
    static constexpr int WORDS = 8;
    static constexpr int NT = 4;  // n8 tiles per warp
    __device__ static u32 factor(u32 s) { u32 f = (s + 120u) << 7; return f | (f << 16); }
    // Chunks of odd rows swap pairwise, so the eight lanes of a 16-byte phase (rows g, g + 1)
    // hit eight different bank groups.
    __device__ static int chunk_at(int n, int c) { return n * ROW_BYTES + ((c ^ (n & 1)) * 16); }
    __device__ static int chunk_cols() { return 16; }
    __device__ static void decode(const u32* q, int j, int h, u32& b0, u32& b1) {
        const u32 S = 0x80008000u, M = 0x07f007f0u;
        u32 t;  // bytes (c + 2h, c + 2h + 1, c + 2h + 4, c + 2h + 5)
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(t) : "r"(q[2 * j]), "r"(q[2 * j + 1]),
            "r"(h ? 0x7632u : 0x5410u));
        b0 = ((t << 8) & S) | ((t << 4) & M);
        b1 = (t & S) | ((t >> 4) & M);
    }
};

using Fp4 = Fp4T<8>;  // 64 weight rows per warp: the most reuse of each activation fragment

// Where a block's weight rows come from: expert e's matrix at codes + e * e_stride, rows of
// row_bytes, scale rows of sc_ld bytes (FP4: per row; FP8: per 2^shift rows).
struct Weights {
    const u8* codes;
    const u8* scale;
    long long e_stride, s_stride;
    int rows, cols, sc_ld, shift;
};

__device__ __forceinline__ float swiglu(float g, float u, float limit) {
    if (limit > 0.f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g / (1.f + expf(-g)) * u;
}
