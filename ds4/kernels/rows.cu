// Batched decode products on tensor cores: y[b] = W x[b] for b < B <= 8, each weight byte read
// once for the whole batch (docs/PERF.md). W is FP8 E4M3 (one E8M0 scale per 2^shift square
// tile), MXFP4 E2M1 (two codes a byte, low nibble first, one E8M0 scale per 32 columns) or bf16
// words; x and y are fp32.
//
// mma.sync m16n8k16 (bf16 in, fp32 accumulate): A = 16 weight rows x 16 k decoded in
// registers, B = 16 k x 8 columns, the columns being the batch. Codes become bf16 with integer
// bit moves: an E2M1 nibble s|eem as (s << 15) | (eem << 6) is its value times 2^-126 (the
// subnormal 0.5 lands on a bf16 subnormal), an E4M3 byte s|eeee|mmm as (s << 15) |
// ((byte & 0x7f) << 4) its value times 2^-120; one bf16x2 multiply by 2^(scale - 127 + bias -
// 32) then gives the weight times 2^-32 exactly (a code has at most 4 significant bits). x is
// scaled by 2^32 (exact) and split into bf16 hi + lo, so W x = W hi + W lo to about 2^-17 of
// |W| |x|. For B <= 4 hi and lo share one n = 8 tile (columns 0..3 hi, 4..7 lo), else two mmas.
//
// Fragment layout (lane = 4 * g + t): A a[0] = row g, k 2t..2t+1; a[1] = row g + 8, same k;
// a[2] = row g, k 2t+8..2t+9; a[3] = row g + 8; B b0 = k 2t..2t+1, b1 = k 2t+8..2t+9 of column
// g; D d[0..1] = row g, columns 2t, 2t+1, d[2..3] = row g + 8. A dot product does not care
// which k slot holds which column, so lane t feeds its own 16-byte chunk of codes (columns
// [k-tile + t * CH, + CH)) and the matching x (F::xcol says which column sits in which slot).
//
// Row independence: a block's warps split k into fixed spans by shape only, and their partial
// sums (hi + lo per warp) are added in warp order; an mma column depends on its own B column
// only. So y[b] is bitwise the same for any B and any other rows of the batch.

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

// bf16x2 word (lo in the low half), rounded to nearest even.
__device__ __forceinline__ u32 bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Both halves multiplied; subnormal inputs are kept, and the product is exact here.
__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
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
    return (e << 7) | (e << 23);
}

// A format: CH columns per lane-chunk (LOADS 16-byte loads per row), MMAS mmas per chunk.
// decode(q, m, mul, lo, hi): the A words of mma m for one row (slots 2t.. and 2t+8..).
// xcol(m, r, h): the chunk column in half h of B register r of mma m.
struct Fp8 {
    static constexpr int CH = 16, LOADS = 1, MMAS = 4;
    static constexpr bool SCALED = true, NONE = false;
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
    static constexpr bool SCALED = true, NONE = false;
    __device__ static size_t bytes(long long cols) { return cols >> 1; }
    __device__ static const u8* scale_row(const u8* s, int row, int ld, int) {
        return s + (size_t)row * ld;
    }
    __device__ static u32 mul(const u8* srow, int col, int) {
        return multiplier(__ldg(srow + (col >> 5)), 126 - 32);
    }
    // Nibbles i and i + 4 of a word as one bf16x2 pair (columns 8w + i, 8w + i + 4).
    __device__ static u32 nibbles(u32 w, int i) {
        const u32 S = 0x80008000u, M = 0x01c001c0u;
        u32 sign = (w << (12 - 4 * i)) & S;
        u32 mag = i < 2 ? (w << (6 - 4 * i)) & M : (w >> (4 * i - 6)) & M;
        return sign | mag;
    }
    // mma m = 2w + u: pairs i = 2u (slots 2t..) and i = 2u + 1 (slots 2t+8..) of word w.
    __device__ static void decode(const uint4* q, int m, u32 mul, u32& lo, u32& hi) {
        u32 w = word(q[0], m >> 1);
        lo = bf16x2_mul(nibbles(w, 2 * (m & 1)), mul);
        hi = bf16x2_mul(nibbles(w, 2 * (m & 1) + 1), mul);
    }
    __device__ static constexpr int xcol(int m, int r, int h) {
        return 8 * (m >> 1) + 2 * (m & 1) + r + 4 * h;
    }
};

struct Bf16 {
    static constexpr int CH = 16, LOADS = 2, MMAS = 4;
    static constexpr bool SCALED = false, NONE = false;
    __device__ static size_t bytes(long long cols) { return cols * 2; }
    __device__ static const u8* scale_row(const u8*, int, int, int) { return nullptr; }
    __device__ static u32 mul(const u8*, int, int) { return 0; }
    __device__ static void decode(const uint4* q, int m, u32, u32& lo, u32& hi) {
        lo = word(q[m >> 1], (2 * m) & 3);
        hi = word(q[m >> 1], (2 * m + 1) & 3);
    }
    __device__ static constexpr int xcol(int m, int r, int h) { return 4 * m + 2 * r + h; }
};

// The rows one warp multiplies: MT tiles of 16 rows, for each its rows g and g + 8 (byte
// pointers of the row start and of its scale row).
template <int MT>
struct Tiles {
    const u8* w[MT][2];
    const u8* s[MT][2];
};

template <class F, int MT>
__device__ __forceinline__ void set_tile(Tiles<MT>& tl, int mt, const u8* W, const u8* S,
                                         int row0, int rows, long long cols, int sc_ld,
                                         int shift) {
    int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int r = min(row0 + g + 8 * h, rows - 1);
        tl.w[mt][h] = W + (size_t)r * F::bytes(cols);
        tl.s[mt][h] = F::SCALED ? F::scale_row(S, r, sc_ld, shift) : nullptr;
    }
}

// DEPTH k-tiles of codes for all MT tiles, loaded together (the bytes in flight per lane).
template <class F, int MT, int DEPTH>
struct Stage {
    uint4 q[DEPTH][MT][2][F::LOADS];
    u32 mul[DEPTH][MT][2];
};

template <class F, int MT, int DEPTH>
__device__ __forceinline__ void load_stage(Stage<F, MT, DEPTH>& st, const Tiles<MT>& tl,
                                           int kt, int kt1, int cols, int shift) {
    int t = threadIdx.x & 3;
#pragma unroll
    for (int d = 0; d < DEPTH; d++) {
        int col = (kt + d) * 4 * F::CH + t * F::CH;
        bool ok = kt + d < kt1 && col < cols;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint4* p = (const uint4*)(tl.w[mt][h] + F::bytes(col));
#pragma unroll
                for (int l = 0; l < F::LOADS; l++)
                    st.q[d][mt][h][l] = ok ? __ldcs(p + l) : make_uint4(0, 0, 0, 0);
                st.mul[d][mt][h] = ok && F::SCALED ? F::mul(tl.s[mt][h], col, shift) : 0u;
            }
    }
}

// The lane's CH floats of its x column at chunk column col, times 2^32 for scaled formats
// (zeros outside the matrix or for a lane without a column).
template <class F>
__device__ __forceinline__ void load_x(const float* xc, int col, int cols, float* xr) {
    bool ok = xc != nullptr && col < cols;
    const float4* v = (const float4*)(xc + (ok ? col : 0));
    const float k = F::SCALED ? X_SCALE : 1.f;
#pragma unroll
    for (int i = 0; i < F::CH / 4; i++) {
        float4 f = ok ? __ldg(v + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        xr[4 * i] = f.x * k; xr[4 * i + 1] = f.y * k; xr[4 * i + 2] = f.z * k;
        xr[4 * i + 3] = f.w * k;
    }
}

// acc[mt][n] += the stage's k-tiles: NT = 1 puts hi in columns 0..3 and lo in 4..7 of one
// tile (lanes g >= 4 feed lo), NT = 2 runs a hi and a lo mma.
template <class F, int MT, int DEPTH, int NT>
__device__ __forceinline__ void mma_stage(const Stage<F, MT, DEPTH>& st, const float* xc,
                                          int kt, int kt1, int cols, float (&acc)[MT][NT][4]) {
    int t = threadIdx.x & 3, g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int d = 0; d < DEPTH; d++) {
        if (kt + d >= kt1) break;
        float xr[F::CH];
        load_x<F>(xc, (kt + d) * 4 * F::CH + t * F::CH, cols, xr);
#pragma unroll
        for (int m = 0; m < F::MMAS; m++) {
            u32 hi0, lo0, hi1, lo1;
            split_pair(xr[F::xcol(m, 0, 0)], xr[F::xcol(m, 0, 1)], hi0, lo0);
            split_pair(xr[F::xcol(m, 1, 0)], xr[F::xcol(m, 1, 1)], hi1, lo1);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                u32 a[4];
                F::decode(st.q[d][mt][0], m, st.mul[d][mt][0], a[0], a[2]);
                F::decode(st.q[d][mt][1], m, st.mul[d][mt][1], a[1], a[3]);
                if constexpr (NT == 1) {
                    mma_bf16(acc[mt][0], a, g < 4 ? hi0 : lo0, g < 4 ? hi1 : lo1);
                } else {
                    mma_bf16(acc[mt][0], a, hi0, hi1);
                    mma_bf16(acc[mt][1], a, lo0, lo1);
                }
            }
        }
    }
}

// v[mt][i] = this warp's sum over k-tiles [kt0, kt1) of its tiles for the lane's outputs
// (i: row g col 2t, row g col 2t + 1, row g + 8 col 2t, row g + 8 col 2t + 1; column = slot
// of the batch), hi + lo already added. xc: the lane's B column of x (nullptr: none).
template <class F, int MT, int DEPTH, int NT>
__device__ __forceinline__ void warp_rows(const Tiles<MT>& tl, const float* xc, int kt0, int kt1,
                                          int cols, int shift, float (&v)[MT][4]) {
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mt][n][i] = 0.f;
    Stage<F, MT, DEPTH> cur, nxt;
    load_stage(cur, tl, kt0, kt1, cols, shift);
    for (int kt = kt0; kt < kt1; kt += DEPTH) {
        if (kt + DEPTH < kt1) load_stage(nxt, tl, kt + DEPTH, kt1, cols, shift);
        mma_stage<F, MT, DEPTH, NT>(cur, xc, kt, kt1, cols, acc);
        cur = nxt;
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if constexpr (NT == 1) {
                v[mt][i] = acc[mt][0][i] + __shfl_down_sync(0xffffffffu, acc[mt][0][i], 2);
            } else {
                v[mt][i] = acc[mt][0][i] + acc[mt][1][i];
            }
        }
}

// The block's KW warps of one row group add their partial sums in warp order (deterministic);
// warp kw == 0 of the group ends with the totals in v. All warps of the block must call it.
template <int MT>
__device__ __forceinline__ void reduce_k(float (&v)[MT][4], int kw, int KW, float* red) {
    if (KW == 1) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();  // the previous item's readers are done
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[((warp * MT + mt) * 4 + i) * 32 + lane] = v[mt][i];
    __syncthreads();
    if (kw != 0) return;
    for (int j = 1; j < KW; j++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                v[mt][i] += red[(((warp + j) * MT + mt) * 4 + i) * 32 + lane];
}

// The k-tiles of warp kw of KW: a fixed share of ceil(cols / (4 CH)) by shape only.
template <class F>
__device__ __forceinline__ void k_span(int cols, int kw, int KW, int& kt0, int& kt1) {
    int tiles = (cols + 4 * F::CH - 1) / (4 * F::CH);
    kt0 = kw * tiles / KW;
    kt1 = (kw + 1) * tiles / KW;
}

// Output (row, column) of entry i of a lane's v.
__device__ __forceinline__ int out_row(int row0, int i) {
    return row0 + ((threadIdx.x & 31) >> 2) + 8 * (i >> 1);
}
__device__ __forceinline__ int out_col(int i) { return 2 * (threadIdx.x & 3) + (i & 1); }

// The lane's B column: batch slot n = g (NT = 2) or g & 3 (NT = 1, hi and lo halves).
template <int NT>
__device__ __forceinline__ int lane_slot() {
    int g = (threadIdx.x & 31) >> 2;
    return NT == 1 ? (g & 3) : g;
}

// One row group (MT * 16 rows from row0) of y[b] = W x[b], its k split over the block's KW
// warps; row r reads x[b] + (r / rows_per_group) * cols.
template <class F, int MT, int DEPTH, int NT>
__device__ __forceinline__ void matvec_group(const u8* W, const u8* S, int rows, int cols,
                                             int sc_ld, int shift, const float* x,
                                             long long x_ld, int rows_per_group, float* y,
                                             long long y_ld, int batch, int KW, int group,
                                             float* red) {
    int warp = threadIdx.x >> 5, kw = warp % KW;
    int row0 = (group * (RW / KW) + warp / KW) * 16 * MT;
    float v[MT][4] = {};
    if (row0 < rows) {
        Tiles<MT> tl;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
            set_tile<F, MT>(tl, mt, W, S, row0 + 16 * mt, rows, cols, sc_ld, shift);
        int slot = lane_slot<NT>(), kt0, kt1;
        const float* xc = slot < batch
            ? x + slot * x_ld + (size_t)(row0 / rows_per_group) * cols : nullptr;
        k_span<F>(cols, kw, KW, kt0, kt1);
        warp_rows<F, MT, DEPTH, NT>(tl, xc, kt0, kt1, cols, shift, v);
    }
    reduce_k<MT>(v, kw, KW, red);
    if (kw != 0 || row0 >= rows) return;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = out_row(row0 + 16 * mt, i), c = out_col(i);
            if (r < rows && c < batch && (NT == 2 || (threadIdx.x & 3) < 2))
                y[c * y_ld + r] = v[mt][i];
        }
}

#define MATVEC_ARGS const u8* __restrict__ W, const u8* __restrict__ S, int rows, int cols, \
    int sc_ld, int shift, const float* __restrict__ x, long long x_ld, int rows_per_group, \
    float* y, long long y_ld, int batch, int KW
#define MATVEC(F, MT, DEPTH, NT) \
    extern "C" __global__ void __launch_bounds__(32 * RW) \
    rows_matvec_##F##_m##MT##_d##DEPTH##_n##NT(MATVEC_ARGS) { \
        __shared__ float red[RW * MT * 4 * 32]; \
        matvec_group<F, MT, DEPTH, NT>(W, S, rows, cols, sc_ld, shift, x, x_ld, rows_per_group, \
                                       y, y_ld, batch, KW, blockIdx.x, red); }
// (tiles per warp, k-tiles per stage) variants: rows.py picks one per shape
#define MATVEC_NT(F, MT, DEPTH) MATVEC(F, MT, DEPTH, 1) MATVEC(F, MT, DEPTH, 2)
#define MATVEC_VARIANTS(F) MATVEC_NT(F, 1, 4) MATVEC_NT(F, 2, 2) MATVEC_NT(F, 1, 8) \
    MATVEC_NT(F, 2, 4) MATVEC_NT(F, 4, 2)

MATVEC_VARIANTS(Fp8)
MATVEC_VARIANTS(Fp4)
MATVEC_NT(Bf16, 1, 4)
MATVEC_NT(Bf16, 2, 2)

// Several matrices of one width multiplying the same x, one launch. table[ENTRY * m ..] =
// (codes, scales, y, rows, format 0 fp8 / 1 fp4 / 2 bf16, scale ld, shift, y_ld, first block):
// blocks [first, next first) compute matrix m, one row group each.
constexpr int ENTRY = 9;

template <int NT>
__device__ void matvec_table(const long long* __restrict__ table, int count, const float* x,
                             long long x_ld, int cols, int batch, int KW, float* red) {
    int m = 0;
    while (m + 1 < count && (long long)blockIdx.x >= table[ENTRY * (m + 1) + 8]) m++;
    const long long* e = table + ENTRY * m;
    const u8 *W = (const u8*)e[0], *S = (const u8*)e[1];
    float* y = (float*)e[2];
    int rows = (int)e[3], fmt = (int)e[4], sc_ld = (int)e[5], shift = (int)e[6];
    int group = blockIdx.x - (int)e[8];
    if (fmt == 0)
        matvec_group<Fp8, 1, 4, NT>(W, S, rows, cols, sc_ld, shift, x, x_ld, rows, y, e[7],
                                    batch, KW, group, red);
    else if (fmt == 1)
        matvec_group<Fp4, 1, 4, NT>(W, S, rows, cols, sc_ld, shift, x, x_ld, rows, y, e[7],
                                    batch, KW, group, red);
    else
        matvec_group<Bf16, 1, 4, NT>(W, S, rows, cols, sc_ld, shift, x, x_ld, rows, y, e[7],
                                     batch, KW, group, red);
}

#define MANY_ARGS const long long* __restrict__ table, int count, const float* __restrict__ x, \
    long long x_ld, int cols, int batch, int KW
extern "C" __global__ void __launch_bounds__(32 * RW) rows_many_n1(MANY_ARGS) {
    __shared__ float red[RW * 4 * 32];
    matvec_table<1>(table, count, x, x_ld, cols, batch, KW, red);
}
extern "C" __global__ void __launch_bounds__(32 * RW) rows_many_n2(MANY_ARGS) {
    __shared__ float red[RW * 4 * 32];
    matvec_table<2>(table, count, x, x_ld, cols, batch, KW, red);
}

// MoE of B tokens: the (token, slot) pairs p = b * k + j grouped by expert, each distinct expert
// read once with its tokens as the batch columns. units[0] = number of experts hit; unit u at
// units + 1 + UNIT * u: (expert, count, pairs in increasing order). A token picks an expert at
// most once, so count <= B <= 8. Optional (null: off): on_host[e] != 0 puts the units of experts
// in mapped host memory first (the persistent grids take items in unit order, so their slow
// PCIe reads start in the first wave); *live members only (tokens b >= *live are idle rows of a
// graph: their pairs join no unit, so they read no expert); counts[e] += the live picks of e
// (placement's routing counts: one thread owns each expert, no atomics). Neither the unit order
// nor the idle rows change a live row: a pair's products depend on its own mma column only,
// and rows_moe_sum adds them in slot order.
constexpr int UNIT = 10, MAX_PAIRS = 64;

extern "C" __global__ void rows_moe_group(const int* __restrict__ idx, int pairs, int k,
                                          int n_experts, const int* __restrict__ on_host,
                                          const int* __restrict__ live, int* counts,
                                          int* units) {
    __shared__ int sidx[MAX_PAIRS], wcount[RW], base;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (live) pairs = min(pairs, max(*live, 0) * k);
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) sidx[p] = idx[p];
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    for (int pass = 0; pass < (on_host ? 2 : 1); pass++)  // host experts, then resident ones
        for (int e0 = 0; e0 < n_experts; e0 += blockDim.x) {
            int e = e0 + threadIdx.x, count = 0;
            for (int p = 0; p < pairs; p++) count += sidx[p] == e;
            bool hit = e < n_experts && count > 0 && (!on_host || (on_host[e] != 0) == (pass == 0));
            unsigned int ballot = __ballot_sync(0xffffffffu, hit);
            if (lane == 0) wcount[warp] = __popc(ballot);
            __syncthreads();
            int at = base + __popc(ballot & ((1u << lane) - 1u)), total = 0;
            for (int w = 0; w < RW; w++) {
                at += w < warp ? wcount[w] : 0;
                total += wcount[w];
            }
            if (hit) {
                int* u = units + 1 + UNIT * at;
                u[0] = e;
                int n = 0;
                for (int p = 0; p < pairs && n < 8; p++)
                    if (sidx[p] == e) u[2 + n++] = p;
                u[1] = n;
                if (counts) counts[e] += count;
            }
            __syncthreads();
            if (threadIdx.x == 0) base += total;
            __syncthreads();
        }
    if (threadIdx.x == 0) units[0] = base;
}

// The shared-expert format of kernels without one.
struct NoShared {
    static constexpr bool NONE = true;
};

// A stack of experts (expert e at e * w_stride code bytes, e * s_stride scale bytes), one matrix
// (strides 0), or experts anywhere (wp non-null: expert e's codes at wp[e], its scales at sp[e],
// device or mapped host addresses; a placed stack, whose tables re-placement rewrites between
// graph replays).
struct Bank {
    const u8* w;
    const u8* s;
    const long long* wp;
    const long long* sp;
    long long w_stride, s_stride;
    int sc_ld, shift;
    __device__ const u8* codes(long long e) const {
        return wp ? (const u8*)wp[e] : w + e * w_stride;
    }
    __device__ const u8* scales(long long e) const {
        return sp ? (const u8*)sp[e] : s + e * s_stride;
    }
    // Expert e alone as a one-matrix bank (its addresses resolved once per work item).
    __device__ Bank at(long long e) const {
        return Bank{codes(e), scales(e), nullptr, nullptr, 0, 0, sc_ld, shift};
    }
};

// Work item `item` of a routed part (n_units * tiles items) then a shared part (tiles_s):
// unit (-1 for the shared expert) and row tile.
__device__ __forceinline__ bool moe_item(int item, int n_units, int tiles, int tiles_s,
                                         int& unit, int& tile) {
    if (item < n_units * tiles) {
        unit = item / tiles;
        tile = item - unit * tiles;
        return true;
    }
    unit = -1;
    tile = item - n_units * tiles;
    return tile < tiles_s;
}

// gate/up of one row group: rows j0.. of gate (tile 0) and of up (tile 1, `up_row` rows
// further), x columns of the unit's tokens (or the batch, for the shared expert); act[out
// pair] = silu(min(g, limit)) * clamp(u, +-limit) * weight.
template <class F, int NT>
__device__ void gate_up_group(const Bank& bk, const Bank& up, long long e, int up_row, int inter,
                              int cols,
                              const float* x, long long x_ld, const int* unit, int k,
                              const float* wts, float* act, int batch, float limit, int KW,
                              int tile, float* red) {
    int warp = threadIdx.x >> 5, kw = warp % KW, g = lane_slot<NT>();
    int j0 = (tile * (RW / KW) + warp / KW) * 16;
    float v[2][4] = {};
    if (j0 < inter) {
        Tiles<2> tl;
        set_tile<F, 2>(tl, 0, bk.codes(e), bk.scales(e), j0, inter, cols, bk.sc_ld, bk.shift);
        set_tile<F, 2>(tl, 1, up.codes(e), up.scales(e), up_row + j0, up_row + inter, cols,
                       up.sc_ld, up.shift);
        int n = unit ? unit[1] : batch, kt0, kt1;
        const float* xc = g < n ? x + (unit ? unit[2 + g] / k : g) * x_ld : nullptr;
        k_span<F>(cols, kw, KW, kt0, kt1);
        warp_rows<F, 2, 2, NT>(tl, xc, kt0, kt1, cols, bk.shift, v);
    }
    reduce_k<2>(v, kw, KW, red);
    if (kw != 0 || j0 >= inter) return;
    int n = unit ? unit[1] : batch;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int j = out_row(j0, i), c = out_col(i);
        if (j >= inter || c >= n) continue;
        int p = unit ? unit[2 + c] : c;
        float gs = v[0][i], us = v[1][i];
        if (limit > 0.f) {
            gs = fminf(gs, limit);
            us = fminf(fmaxf(us, -limit), limit);
        }
        act[(size_t)p * inter + j] = gs / (1.f + expf(-gs)) * us * (unit ? wts[p] : 1.f);
    }
}

// down of one row group (32 rows): out[out pair][r] = down_e[r] . act[pair].
template <class F, int NT>
__device__ void down_group(const Bank& bk, long long e, int rows, int inter, const float* act,
                           const int* unit, float* out, int batch, int KW, int tile,
                           float* red) {
    int warp = threadIdx.x >> 5, kw = warp % KW, g = lane_slot<NT>();
    int r0 = (tile * (RW / KW) + warp / KW) * 32;
    float v[2][4] = {};
    if (r0 < rows) {
        Tiles<2> tl;
        const u8 *W = bk.codes(e), *S = bk.scales(e);
        set_tile<F, 2>(tl, 0, W, S, r0, rows, inter, bk.sc_ld, bk.shift);
        set_tile<F, 2>(tl, 1, W, S, r0 + 16, rows, inter, bk.sc_ld, bk.shift);
        int n = unit ? unit[1] : batch, kt0, kt1;
        const float* xc = g < n ? act + (size_t)(unit ? unit[2 + g] : g) * inter : nullptr;
        k_span<F>(inter, kw, KW, kt0, kt1);
        warp_rows<F, 2, 2, NT>(tl, xc, kt0, kt1, inter, bk.shift, v);
    }
    reduce_k<2>(v, kw, KW, red);
    if (kw != 0 || r0 >= rows) return;
    int n = unit ? unit[1] : batch;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = out_row(r0 + 16 * mt, i), c = out_col(i);
            if (r < rows && c < n) out[(size_t)(unit ? unit[2 + c] : c) * rows + r] = v[mt][i];
        }
}

#define BANK_ARGS(p) const u8* __restrict__ p##_w, const u8* __restrict__ p##_s, \
    const long long* __restrict__ p##_wp, const long long* __restrict__ p##_sp, \
    long long p##_ws, long long p##_ss, int p##_ld, int p##_shift
#define BANK(p) Bank{p##_w, p##_s, p##_wp, p##_sp, p##_ws, p##_ss, p##_ld, p##_shift}
#define MOE_GATE_UP_ARGS BANK_ARGS(rb), BANK_ARGS(sg), BANK_ARGS(su), \
    const int* __restrict__ units, int routed, int k, const float* __restrict__ wts, \
    const float* __restrict__ x, long long x_ld, float* act, float* sact, int inter, \
    int s_inter, int cols, int batch, float limit, int KW, int tiles, int tiles_s
#define MOE_DOWN_ARGS BANK_ARGS(rb), BANK_ARGS(sd), const int* __restrict__ units, \
    int routed, const float* __restrict__ act, const float* __restrict__ sact, float* part, \
    float* spart, int rows, int inter, int s_inter, int batch, int KW, int tiles, int tiles_s

// Persistent grid over the items of the routed experts hit, then the shared expert's.
template <class F, class FS, int NT>
__device__ void moe_gate_up(const Bank& rb, const Bank& sg, const Bank& su, const int* units,
                            int routed, int k, const float* wts, const float* x,
                            long long x_ld, float* act, float* sact, int inter, int s_inter,
                            int cols, int batch, float limit, int KW, int tiles, int tiles_s) {
    __shared__ float red[RW * 2 * 4 * 32];
    int n_units = routed ? units[0] : 0, unit, tile;
    for (int item = blockIdx.x; moe_item(item, n_units, tiles, tiles_s, unit, tile);
         item += gridDim.x) {
        if (unit >= 0) {
            const int* u = units + 1 + UNIT * unit;
            Bank ex = rb.at(u[0]);
            gate_up_group<F, NT>(ex, ex, 0, inter, inter, cols, x, x_ld, u, k, wts, act,
                                 batch, limit, KW, tile, red);
        } else if constexpr (!FS::NONE) {
            gate_up_group<FS, NT>(sg, su, 0, 0, s_inter, cols, x, x_ld, nullptr, k, wts, sact,
                                  batch, limit, KW, tile, red);
        }
    }
}

template <class F, class FS, int NT>
__device__ void moe_down(const Bank& rb, const Bank& sd, const int* units, int routed,
                         const float* act, const float* sact, float* part, float* spart,
                         int rows, int inter, int s_inter, int batch, int KW, int tiles,
                         int tiles_s) {
    __shared__ float red[RW * 2 * 4 * 32];
    int n_units = routed ? units[0] : 0, unit, tile;
    for (int item = blockIdx.x; moe_item(item, n_units, tiles, tiles_s, unit, tile);
         item += gridDim.x) {
        if (unit >= 0) {
            const int* u = units + 1 + UNIT * unit;
            down_group<F, NT>(rb.at(u[0]), 0, rows, inter, act, u, part, batch, KW, tile, red);
        } else if constexpr (!FS::NONE) {
            down_group<FS, NT>(sd, 0, rows, s_inter, sact, nullptr, spart, batch, KW, tile, red);
        }
    }
}

// NT = 1 (hi and lo in one tile) serves calls of up to 4 tokens, NT = 2 up to 8; the trailing
// arguments are the launch bounds (`32 * RW, 1` where ptxas would otherwise squeeze a kernel
// that needs more than 128 registers, one block per SM either way, into 128 and spill).
#define MOE_NT(name, F, FS, NT, ...) \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) \
    rows_gate_up_##name##_n##NT(MOE_GATE_UP_ARGS) { \
        moe_gate_up<F, FS, NT>(BANK(rb), BANK(sg), BANK(su), units, routed, k, wts, x, x_ld, \
                               act, sact, inter, s_inter, cols, batch, limit, KW, tiles, \
                               tiles_s); } \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) \
    rows_down_##name##_n##NT(MOE_DOWN_ARGS) { \
        moe_down<F, FS, NT>(BANK(rb), BANK(sd), units, routed, act, sact, part, spart, rows, \
                            inter, s_inter, batch, KW, tiles, tiles_s); }
#define MOE_B(name, F, FS, ...) MOE_NT(name, F, FS, 1, __VA_ARGS__) \
    MOE_NT(name, F, FS, 2, __VA_ARGS__)
#define MOE(name, F, FS) MOE_B(name, F, FS, 32 * RW)

MOE_B(fp4_fp8, Fp4, Fp8, 32 * RW, 1)
MOE(fp4_bf16, Fp4, Bf16)
MOE(fp8_fp8, Fp8, Fp8)
MOE(bf16_bf16, Bf16, Bf16)
// routed experts alone (fewer registers, more blocks per SM); the shared expert then runs
// through a launch of the kernels above with routed = 0
MOE(fp4_none, Fp4, NoShared)
MOE(fp8_none, Fp8, NoShared)
MOE(bf16_none, Bf16, NoShared)

// y[b] = sum_j part[b * k + j] in slot order, then + spart[b] (the shared expert), as the
// unbatched kernels add the shared expert onto the routed sum. Idle rows (b >= *live, live
// non-null) joined no unit, so their part rows hold nothing of this call: their routed sum is 0.
extern "C" __global__ void rows_moe_sum(const float* __restrict__ part,
                                        const float* __restrict__ spart, int k, int rows,
                                        int batch, const int* __restrict__ live, float* y,
                                        long long y_ld) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= batch * rows) return;
    int b = t / rows, r = t - b * rows;
    float s = 0.f;
    if (!live || b < *live) {
        const float* p = part + (size_t)b * k * rows + r;
        s = p[0];
        for (int j = 1; j < k; j++) s += p[(size_t)j * rows];
    }
    if (spart) s = s + spart[(size_t)b * rows + r];
    y[b * y_ld + r] = s;
}

// Test hook: the bf16 words the mma path feeds for each code (times 2^32 = the weight), in
// column order, out [rows, cols]: checks the bit moves and the bf16x2 multiply on the device.
template <class F>
__device__ void decode_words(const u8* W, const u8* S, int rows, int cols, int sc_ld, int shift,
                             unsigned short* out) {
    int chunk = blockIdx.x * blockDim.x + threadIdx.x, per_row = cols / F::CH;
    if (chunk >= rows * per_row) return;
    int r = chunk / per_row, col = (chunk - r * per_row) * F::CH;
    uint4 q[F::LOADS];
    const uint4* p = (const uint4*)(W + (size_t)r * F::bytes(cols) + F::bytes(col));
    for (int l = 0; l < F::LOADS; l++) q[l] = p[l];
    u32 mul = F::SCALED ? F::mul(F::scale_row(S, r, sc_ld, shift), col, shift) : 0u;
    unsigned short* o = out + (size_t)r * cols + col;
#pragma unroll
    for (int m = 0; m < F::MMAS; m++) {
        u32 lo, hi;
        F::decode(q, m, mul, lo, hi);
        o[F::xcol(m, 0, 0)] = lo & 0xffff;
        o[F::xcol(m, 0, 1)] = lo >> 16;
        o[F::xcol(m, 1, 0)] = hi & 0xffff;
        o[F::xcol(m, 1, 1)] = hi >> 16;
    }
}

#define DECODE_ARGS const u8* __restrict__ W, const u8* __restrict__ S, int rows, int cols, \
    int sc_ld, int shift, unsigned short* out
extern "C" __global__ void rows_decode_fp8(DECODE_ARGS) {
    decode_words<Fp8>(W, S, rows, cols, sc_ld, shift, out);
}
extern "C" __global__ void rows_decode_fp4(DECODE_ARGS) {
    decode_words<Fp4>(W, S, rows, cols, sc_ld, shift, out);
}
