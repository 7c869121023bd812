// The weight formats of the batched decode products (ds4/kernels/rows.cuh) and the mma
// words they feed: mma wrappers, bf16 / f16 conversions, and per format how a lane's
// 16-byte code chunk becomes A words and which x column sits in which B slot.
//
// mma.sync m16n8k16 (bf16 in, fp32 accumulate): A = 16 weight rows x 16 k decoded in
// registers, B = 16 k x 8 columns, the columns being the batch. Codes become bf16 with integer
// bit moves: an E2M1 nibble s|eem as (s << 15) | (eem << 6) is its value times 2^-126 (the
// subnormal 0.5 lands on a bf16 subnormal), an E4M3 byte s|eeee|mmm as (s << 15) |
// ((byte & 0x7f) << 4) its value times 2^-120; one bf16x2 multiply by 2^(scale - 127 + bias -
// 32) then gives the weight times 2^-32 exactly (a code has at most 4 significant bits). x is
// scaled by 2^32 (exact) and split into bf16 hi + lo, so W x = W hi + W lo to about 2^-17 of
// |W| |x|. For B <= 4 hi and lo share one n = 8 tile (columns 0..3 hi, 4..7 lo), else two mmas.
// FP8 in scale tiles of 64 or more takes f16 mmas instead (Fp8h below, rows.cuh's post_stage).
#pragma once

#include "common.cuh"

typedef unsigned char u8;
typedef unsigned int u32;

constexpr int RW = 8;  // warps per block (the launchers' block size)
constexpr float X_SCALE = 4294967296.f;  // 2^32: codes carry 2^-32, x carries 2^32

__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_f16(float* d, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// bf16x2 word (lo in the low half), rounded to nearest even.
__device__ __forceinline__ u32 bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Both halves multiplied; subnormal inputs are kept, and the product is exact here. Before
// sm_90 (no mul.bf16x2) a fused multiply-add of -0 gives the same bits.
__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
    u32 r;
#if DS4_ARCH >= 900
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
#endif
    return r;
}

// x0, x1 = hi + lo up to 2^-17 of them: hi and lo as bf16x2 words.
__device__ __forceinline__ void split_pair(float x0, float x1, u32& hi, u32& lo) {
    hi = bf16x2(x0, x1);
    lo = bf16x2(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

__device__ __forceinline__ u32 word(const uint4& q, int i) {
    return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// bf16x2 multiplier 2^(s + bias - 127) in both halves (bias folds the decode's power of two).
__device__ __forceinline__ u32 multiplier(u32 s, int bias) {
    u32 e = s + bias > 254u ? 254u : s + bias;  // past 2^127: E8M0 scales above 2^33 overflow
    return e * 0x00800080u;  // (e << 7) | (e << 23): one multiply
}

// A format: CH columns per lane-chunk (LOADS 16-byte loads per row), MMAS mmas per chunk.
// decode(q, m, mul, lo, hi): the A words of mma m for one row (slots 2t.. and 2t+8..).
// xcol(m, r, h): the chunk column in half h of B register r of mma m.
struct Fp8 {
    static constexpr int CH = 16, LOADS = 1, MMAS = 4;
    static constexpr bool SCALED = true, NONE = false, POST = false;
    __device__ static size_t bytes(long long cols) { return cols; }
    __device__ static const u8* scale_row(const u8* s, int row, int ld, int shift) {
        return s + (size_t)(row >> shift) * ld;
    }
    __device__ static u32 mul(const u8* srow, int col, int shift) {
        return multiplier(__ldg(srow + (col >> shift)), 120 - 32);
    }
    // Word m holds columns 4m..4m+3: pairs (4m, 4m+2) and (4m+1, 4m+3).
    __device__ static void decode(const uint4* q, int m, u32 mul, u32& lo, u32& hi) {
        const u32 S = 0x80008000u, M = 0x07f007f0u, w = word(q[0], m);
        lo = bf16x2_mul(((w << 8) & S) | ((w << 4) & M), mul);
        hi = bf16x2_mul((w & S) | ((w >> 4) & M), mul);
    }
    __device__ static constexpr int xcol(int m, int r, int h) { return 4 * m + r + 2 * h; }
};

struct Fp4 {
    static constexpr int CH = 32, LOADS = 1, MMAS = 8;
    static constexpr bool SCALED = true, NONE = false, POST = false;
    __device__ static size_t bytes(long long cols) { return cols >> 1; }
    __device__ static const u8* scale_row(const u8* s, int row, int ld, int) {
        return s + (size_t)row * ld;
    }
    __device__ static u32 mul(const u8* srow, int col, int) {
        return multiplier(__ldg(srow + (col >> 5)), 126 - 32);
    }
    // mma m = 2w + u: pairs i = 2u (slots 2t..) and i = 2u + 1 (slots 2t+8..) of word w.
    __device__ static void decode(const uint4* q, int m, u32 mul, u32& lo, u32& hi) {
        e2m1_pairs(word(q[0], m >> 1), m & 1, lo, hi);  // (common.cuh)
        lo = bf16x2_mul(lo, mul), hi = bf16x2_mul(hi, mul);
    }
    __device__ static constexpr int xcol(int m, int r, int h) {
        return 8 * (m >> 1) + 2 * (m & 1) + r + 4 * h;
    }
};

struct Bf16 {
    static constexpr int CH = 16, LOADS = 2, MMAS = 4;
    static constexpr bool SCALED = false, NONE = false, POST = false;
    __device__ static size_t bytes(long long cols) { return cols * 2; }
    __device__ static const u8* scale_row(const u8*, int, int, int) { return nullptr; }
    __device__ static u32 mul(const u8*, int, int) { return 0; }
    __device__ static void decode(const uint4* q, int m, u32, u32& lo, u32& hi) {
        lo = word(q[m >> 1], (2 * m) & 3);
        hi = word(q[m >> 1], (2 * m + 1) & 3);
    }
    __device__ static constexpr int xcol(int m, int r, int h) { return 4 * m + 2 * r + h; }
};

// FP8 in square scale tiles of >= 64 (shift >= 6) through f16 mmas: a 16-row tile and a k-tile
// of 64 columns lie in one scale tile, so cvt.rn.f16x2.e4m3x2 feeds the codes as they are (one
// instruction per two codes, exact) and the tile's scale multiplies the k-tile's fp32 sums
// (POST: post_stage). mul is the scale as the float bits of 2^(s - 127). x comes in f16 hi + lo
// under a power of two per k-tile and batch column (split_f16).
// (Fp8's chunk, bytes and scale rows.)
struct Fp8h : Fp8 {
    static constexpr bool POST = true;
    __device__ static u32 mul(const u8* srow, int col, int shift) {
        return (u32)__ldg(srow + (col >> shift)) << 23;
    }
    // Word m holds columns 4m..4m+3: lo = (4m, 4m+1), hi = (4m+2, 4m+3).
    __device__ static void decode(const uint4* q, int m, u32, u32& lo, u32& hi) {
        e4m3x4(word(q[0], m), lo, hi);
    }
    __device__ static constexpr int xcol(int m, int r, int h) { return 4 * m + 2 * r + h; }
};

// f16x2 word (lo in the low half), rounded to nearest even.
__device__ __forceinline__ u32 f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

constexpr float F16_ROUND = 201326592.f;  // 1.5 * 2^27: (v + it) - it is v to a multiple of 16

// The power of two of a k-tile whose largest |x| is big: x times sc lies under 2^15, un = 1/sc
// = 2^(e - 141) for big's exponent field e (at least 15, so both are normal floats).
__device__ __forceinline__ void f16_power(float big, float& sc, float& un) {
    u32 e = max(__float_as_uint(big) >> 23, 15u);
    sc = __uint_as_float((268u - e) << 23);
    un = __uint_as_float((e - 14u) << 23);
}

// x0, x1 times sc as f16 hi (to a multiple of 16, exact in f16) + lo (the rest) words.
__device__ __forceinline__ void f16_pair(float x0, float x1, float sc, u32& hi, u32& lo) {
    float v0 = x0 * sc, v1 = x1 * sc;
    float h0 = (v0 + F16_ROUND) - F16_ROUND, h1 = (v1 + F16_ROUND) - F16_ROUND;
    hi = f16x2(h0, h1);
    lo = f16x2(v0 - h0, v1 - h1);
}

// The lane's CH floats of x for a POST format as f16 B words: a power of two per batch column
// (its four lanes t agree on it) puts the k-tile's largest |x| in [2^14, 2^15); hi = x times it
// to a multiple of 16 (exact in f16), lo = the rest in f16 (within 2^-9: 2^-23 of the largest).
// hi[m] / lo[m] = B registers 0 and 1 of mma m; un = the power's inverse (f16_power).
template <class F>
__device__ __forceinline__ void split_f16(const float* xr, u32 (&hi)[F::MMAS][2],
                                          u32 (&lo)[F::MMAS][2], float& un) {
    float big = 0.f, sc;
#pragma unroll
    for (int i = 0; i < F::CH; i++) big = fmaxf(big, fabsf(xr[i]));
    big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, 1));
    big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, 2));
    f16_power(big, sc, un);
#pragma unroll
    for (int m = 0; m < F::MMAS; m++)
#pragma unroll
        for (int r = 0; r < 2; r++)
            f16_pair(xr[F::xcol(m, r, 0)], xr[F::xcol(m, r, 1)], sc, hi[m][r], lo[m][r]);
}
