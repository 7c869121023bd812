// The pieces of ds4/kernels/packed.cu's kernels (its opening comment says how they decode):
// the two chunk formats, where a lane's x comes from, and the dot products of R rows.
#pragma once

#include "common.cuh"

typedef unsigned char u8;

// 2^(s - 127). Code 0 (2^-127) is an fp32 subnormal, which these kernels may flush to zero
// (seen on the H200); no checkpoint scale is that small.
__device__ __forceinline__ float e8m0(unsigned int s) {
    return s ? __uint_as_float(s << 23) : __uint_as_float(0x00400000u);
}

__device__ __forceinline__ float2 halves(unsigned int h) {
    float a, b;
    asm("{.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;}"
        : "=f"(a), "=f"(b) : "r"(h));
    return make_float2(a, b);
}

// Eight E2M1 codes (nibbles of q, low first) as four half2 words h[i] = (code i, code i + 4),
// each half = value * 2^-14: sign to bit 15, exponent and mantissa bits to bits 11..9, which
// is the E2M1 layout with the exponent bias moved from 1 to 15 (subnormal 0.5 included).
__device__ __forceinline__ void e2m1x8(unsigned int q, unsigned int* h) {
    const unsigned int S = 0x80008000u, M = 0x0e000e00u;
    h[0] = ((q << 12) & S) | ((q << 9) & M);
    h[1] = ((q << 8) & S) | ((q << 5) & M);
    h[2] = ((q << 4) & S) | ((q << 1) & M);
    h[3] = (q & S) | ((q >> 3) & M);
}

// One 16-byte chunk of a row: 16 E4M3 codes, or 32 E2M1 codes (one MXFP4 scale block).
struct Fp8 {
    static constexpr int CODES = 16;
    static constexpr float UNIT = 1.f;
    __device__ static int row_bytes(int cols) { return cols; }
    __device__ static const u8* scale_row(const u8* s, int row, int ld, int shift) {
        return s + (size_t)(row >> shift) * ld;
    }
    __device__ static int scale_col(int chunk, int shift) { return (chunk * CODES) >> shift; }
    // The chunk's codes in column order.
    __device__ static void decode(const uint4& w, float* f) {
        const unsigned int q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            unsigned int lo, hi;
            e4m3x4(q[j], lo, hi);
            float2 a = halves(lo), b = halves(hi);
            f[4 * j] = a.x; f[4 * j + 1] = a.y; f[4 * j + 2] = b.x; f[4 * j + 3] = b.y;
        }
    }
};

struct Fp4 {
    static constexpr int CODES = 32;
    static constexpr float UNIT = 16384.f;  // e2m1x8's halves are value * 2^-14
    __device__ static int row_bytes(int cols) { return cols >> 1; }
    __device__ static const u8* scale_row(const u8* s, int row, int ld, int) {
        return s + (size_t)row * ld;
    }
    __device__ static int scale_col(int chunk, int) { return chunk; }
    __device__ static void decode(const uint4& w, float* f) {
        const unsigned int q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            unsigned int h[4];
            e2m1x8(q[j], h);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 v = halves(h[i]);
                f[8 * j + i] = v.x;
                f[8 * j + i + 4] = v.y;
            }
        }
    }
};

// Where a lane's x comes from. A lane's chunk spans CODES floats, so lanes that read x straight
// from global memory touch a cache line each per 16-byte load (through L1): fine for FP8 GEMVs
// (measured best), but FP4 kernels then ran at a sixth of the copy rate. Those stage x in
// shared memory once per block and loop the block over many row tiles (a persistent grid): a
// chunk's F4 = CODES / 4 float4 sit at a stride of F4 + 1, so the 8 lanes of a 16-byte phase
// (consecutive chunks) hit 8 different bank groups.
constexpr int WARPS = 8;  // warps per block (the launchers' fixed block size)

template <class F>
__device__ __forceinline__ void load_x(const float* x, int chunk, float* xr);

struct GlobalX {
    const float* x;
    template <class F>
    __device__ void load(int chunk, float* xr) const { load_x<F>(x, chunk, xr); }
};

struct SharedX {
    const float4* sx;  // chunks from c0 on
    int c0;
    template <class F>
    __device__ void load(int chunk, float* xr) const {
        const float4* v = sx + (chunk - c0) * (F::CODES / 4 + 1);
#pragma unroll
        for (int k = 0; k < F::CODES / 4; k++) {
            float4 t = v[k];
            xr[4 * k] = t.x; xr[4 * k + 1] = t.y; xr[4 * k + 2] = t.z; xr[4 * k + 3] = t.w;
        }
    }
};

// The block copies chunks [c0, c0 + n) of x into sx (coalesced 16-byte loads); the caller syncs.
template <class F>
__device__ __forceinline__ void stage_x(const float* x, int c0, int n, float4* sx) {
    const int f4 = F::CODES / 4;
    const float4* src = (const float4*)(x + (size_t)c0 * F::CODES);
    for (int f = threadIdx.x; f < n * f4; f += blockDim.x)
        sx[(f / f4) * (f4 + 1) + f % f4] = __ldg(src + f);
}

// x[chunk * CODES ...] as CODES floats in registers (16-byte loads through L1).
template <class F>
__device__ __forceinline__ void load_x(const float* x, int chunk, float* xr) {
    const float4* v = (const float4*)(x + (size_t)chunk * F::CODES);
#pragma unroll
    for (int k = 0; k < F::CODES / 4; k++) {
        float4 t = __ldg(v + k);
        xr[4 * k] = t.x; xr[4 * k + 1] = t.y; xr[4 * k + 2] = t.z; xr[4 * k + 3] = t.w;
    }
}

template <class F>
__device__ __forceinline__ float dot_chunk(const uint4& w, const float* xr) {
    float f[F::CODES];
    F::decode(w, f);
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int k = 0; k < F::CODES; k += 2) {
        a = fmaf(f[k], xr[k], a);
        b = fmaf(f[k + 1], xr[k + 1], b);
    }
    return a + b;
}

// Where R consecutive rows from row0 live (rows past the end read the last row; not stored).
template <class F, int R>
struct RowSet {
    const u8* w[R];
    const u8* s[R];
    RowSet() = default;
    __device__ RowSet(const u8* W, const u8* S, int row0, int rows, int cols, int sc_ld,
                      int shift) {
#pragma unroll
        for (int j = 0; j < R; j++) set(j, W, S, min(row0 + j, rows - 1), cols, sc_ld, shift);
    }
    __device__ void set(int j, const u8* W, const u8* S, int r, int cols, int sc_ld, int shift) {
        w[j] = W + (size_t)r * F::row_bytes(cols);
        s[j] = F::scale_row(S, r, sc_ld, shift);
    }
};

// acc[j] += this lane's share of row (row0 + j) . x over chunks [c0, c1): one read of x per
// chunk serves all R rows.
template <class F, int R, class X>
__device__ __forceinline__ void rows_dot(const RowSet<F, R>& rs, const X& xs, int c0, int c1,
                                         int shift, float* acc) {
#pragma unroll 2
    for (int i = c0 + (threadIdx.x & 31); i < c1; i += 32) {
        uint4 w[R];
        float sc[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            w[j] = __ldcs((const uint4*)rs.w[j] + i);
            sc[j] = e8m0(__ldg(rs.s[j] + F::scale_col(i, shift))) * F::UNIT;
        }
        float xr[F::CODES];
        xs.template load<F>(i, xr);
#pragma unroll
        for (int j = 0; j < R; j++) acc[j] = fmaf(dot_chunk<F>(w[j], xr), sc[j], acc[j]);
    }
}

// Lane 0 writes the warp's sums of rows row0 .. row0 + R - 1 (those < rows).
template <int R>
__device__ __forceinline__ void store_rows(float* acc, float* y, int row0, int rows,
                                           bool atomic, int accumulate) {
#pragma unroll
    for (int j = 0; j < R; j++) {
        float v = warp_sum(acc[j]);
        if ((threadIdx.x & 31) != 0 || row0 + j >= rows) continue;
        if (atomic) atomicAdd(y + row0 + j, v);
        else y[row0 + j] = accumulate ? y[row0 + j] + v : v;
    }
}

// Batched: acc[j][b] += row (row0 + j) . x_b for nb <= NB vectors x_b = x + b * x_ld; each chunk
// is decoded once and meets every x_b.
template <class F, int R, int NB>
__device__ __forceinline__ void rows_dot_batch(const RowSet<F, R>& rs, const float* x,
                                               long long x_ld, int nb, int c0, int c1,
                                               int shift, float (*acc)[NB]) {
    for (int i = c0 + (threadIdx.x & 31); i < c1; i += 32) {
        float f[R][F::CODES], sc[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            F::decode(__ldcs((const uint4*)rs.w[j] + i), f[j]);
            sc[j] = e8m0(__ldg(rs.s[j] + F::scale_col(i, shift))) * F::UNIT;
        }
#pragma unroll
        for (int b = 0; b < NB; b++) {
            if (b >= nb) break;
            float xr[F::CODES];
            load_x<F>(x + b * x_ld, i, xr);
#pragma unroll
            for (int j = 0; j < R; j++) {
                float a = 0.f;
#pragma unroll
                for (int k = 0; k < F::CODES; k++) a = fmaf(f[j][k], xr[k], a);
                acc[j][b] = fmaf(a, sc[j], acc[j][b]);
            }
        }
    }
}
