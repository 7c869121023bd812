// Batched decode products of the shared matrices: y[b] = W x[b] for b < B <= 8 on tensor
// cores, one matrix or several of one width per launch (the formats, the mma loop and why
// a row is bitwise the same in any batch: rows.cuh).

#include "common.cuh"
#include "rows.cuh"

// The lane's XSrc for batch column `slot` (< 0: none) of the words stage_x left in sx for KT
// k-tiles of `batch` rows.
template <class F, int NT>
__device__ __forceinline__ XSrc staged_src(const u32* sx, int slot, int KT, int batch) {
    constexpr int W = words_per_lane<F>();
    int t = threadIdx.x & 3, g = (threadIdx.x & 31) >> 2;
    const float* un = (const float*)sx + (size_t)batch * KT * 8 * W;
    int c0 = NT == 1 ? (2 * t) & 3 : 2 * t, c1 = NT == 1 ? (2 * t + 1) & 3 : 2 * t + 1;
    XSrc src{nullptr, nullptr, 4 * W, un + min(c0, batch - 1) * KT, un + min(c1, batch - 1) * KT};
    if (slot >= 0) src.w = sx + (size_t)slot * KT * 8 * W + t * W + (NT == 1 && g >= 4 ? 4 * W : 0);
    return src;
}

// One row group (MT * 16 rows from row0) of y[b] = W x[b], its k split over the block's KW
// warps; row r reads x[b] + (r / rows_per_group) * cols. XS: X_REGS, each warp splits its x
// chunks; X_SHARED, the block splits its x row group once into shared memory sx (stage_x: the
// block's rows must read one x row group, rows.py's staged).
template <class F, int MT, int DEPTH, int NT, int XS>
__device__ __forceinline__ void matvec_group(const u8* W, const u8* S, int rows, int cols,
                                             int sc_ld, int shift, const float* x,
                                             long long x_ld, int rows_per_group, float* y,
                                             long long y_ld, int batch, int KW, int group,
                                             float* red, u32* sx = nullptr) {
    int warp = threadIdx.x >> 5, kw = warp % KW;
    int row0 = (group * (RW / KW) + warp / KW) * 16 * MT;
    auto stage = [&] {
        if constexpr (XS == X_SHARED) {
            int first = group * (RW / KW) * 16 * MT;
            stage_x<F>(x + (long long)(first / rows_per_group) * cols, x_ld, batch, cols, sx);
        }
    };
    float v[MT][4] = {};
    if (row0 >= rows) {  // (warp_rows waits once its first weights are loading)
        wait_inputs();
        stage();
    }
    if (row0 < rows) {
        Tiles<MT> tl;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
            set_tile<F, MT>(tl, mt, W, S, row0 + 16 * mt, rows, cols, sc_ld, shift);
        int slot = lane_slot<NT>(), kt0, kt1;
        XSrc src = XS == X_SHARED
            ? staged_src<F, NT>(sx, slot < batch ? slot : -1,
                                (cols + 4 * F::CH - 1) / (4 * F::CH), batch)
            : lane_src<F, NT, X_REGS>(x, x_ld, nullptr, 0, slot < batch ? slot : -1,
                                      (long long)(row0 / rows_per_group) * cols);
        k_span<F>(cols, kw, KW, kt0, kt1);
        warp_rows<F, MT, DEPTH, NT, XS>(tl, src, kt0, kt1, cols, shift, v, stage);
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
// MINB: blocks an SM must hold (the launch bounds). 2 for the variants of 8 16-byte code loads
// in flight a lane ((1, 4), (2, 2)), which fit 128 registers without spilling (q_b and o_a at
// B > 4 took 139 and so ran one block of 8 warps an SM); 1 where 128 would spill. The _sx
// kernels take x through shared memory (X_SHARED: rows.py sizes their dynamic shared memory).
#define MATVEC_XS(F, MT, DEPTH, NT, MINB, XS, SUFFIX) \
    extern "C" __global__ void __launch_bounds__(32 * RW, MINB) \
    rows_matvec_##F##_m##MT##_d##DEPTH##_n##NT##SUFFIX(MATVEC_ARGS) { \
        __shared__ float red[RW * MT * 4 * 32]; \
        extern __shared__ __align__(16) u32 sx[]; \
        matvec_group<F, MT, DEPTH, NT, XS>(W, S, rows, cols, sc_ld, shift, x, x_ld, \
                                           rows_per_group, y, y_ld, batch, KW, blockIdx.x, red, \
                                           sx); }
#define MATVEC(F, MT, DEPTH, NT, MINB) MATVEC_XS(F, MT, DEPTH, NT, MINB, X_REGS, )
#define MATVEC_SX(F, MT, DEPTH, MINB) MATVEC_XS(F, MT, DEPTH, 1, MINB, X_SHARED, _sx) \
    MATVEC_XS(F, MT, DEPTH, 2, MINB, X_SHARED, _sx)
// (tiles per warp, k-tiles per stage) variants: rows.py picks one per shape
#define MATVEC_NT(F, MT, DEPTH, MINB) MATVEC(F, MT, DEPTH, 1, MINB) MATVEC(F, MT, DEPTH, 2, MINB)
#define MATVEC_VARIANTS(F, MINB22) MATVEC_NT(F, 1, 4, 2) MATVEC_NT(F, 2, 2, MINB22) \
    MATVEC_NT(F, 1, 8, 1) MATVEC_NT(F, 2, 4, 1) MATVEC_NT(F, 4, 2, 1) \
    MATVEC_SX(F, 1, 4, 2) MATVEC_SX(F, 2, 2, MINB22) MATVEC_SX(F, 2, 4, 1)

MATVEC_VARIANTS(Fp8, 2)
MATVEC_VARIANTS(Fp8h, 2)
MATVEC_VARIANTS(Fp4, 1)  // (its two-tile words at B > 4 would spill under 128 registers)
MATVEC_NT(Bf16, 1, 4, 1)
MATVEC_NT(Bf16, 2, 2, 1)
MATVEC_SX(Bf16, 1, 4, 1)
MATVEC_SX(Bf16, 2, 2, 1)

// Up to two split jobs in one launch (blockIdx.y): format codes 0 fp8, 1 fp4 (rows.py's
// FORMAT_CODE); job 1 with n1 = 0 is none.
extern "C" __global__ void rows_split(const float* __restrict__ x0, int n0, int K0, long long ld0,
                                      u32* out0, long long out_ld0, int fmt0,
                                      const float* __restrict__ x1, int n1, int K1, long long ld1,
                                      u32* out1, long long out_ld1, int fmt1) {
    wait_inputs();  // (pdl.py)
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    bool second = blockIdx.y == 1;
    const float* x = second ? x1 : x0;
    int n = second ? n1 : n0, K = second ? K1 : K0, fmt = second ? fmt1 : fmt0;
    long long ld = second ? ld1 : ld0, out_ld = second ? out_ld1 : out_ld0;
    u32* out = second ? out1 : out0;
    if (fmt == 0)
        split_rows<Fp8>(x, n, K, ld, out, out_ld, i);
    else
        split_rows<Fp4>(x, n, K, ld, out, out_ld, i);
}

// Several matrices of one width multiplying the same x, one launch. table[ENTRY * m ..] =
// (codes, scales, y, rows, format 0 fp8 / 1 fp4 / 2 bf16 / 3 fp8 through f16 mmas, scale ld,
// shift, y_ld, first block):
// blocks [first, next first) compute matrix m, one row group each.
constexpr int ENTRY = 9;

template <int NT, int XS>
__device__ void matvec_table(const long long* __restrict__ table, int count, const float* x,
                             long long x_ld, int cols, int batch, int KW, float* red, u32* sx) {
    int m = 0;
    while (m + 1 < count && (long long)blockIdx.x >= table[ENTRY * (m + 1) + 8]) m++;
    const long long* e = table + ENTRY * m;
    const u8 *W = (const u8*)e[0], *S = (const u8*)e[1];
    float* y = (float*)e[2];
    int rows = (int)e[3], fmt = (int)e[4], sc_ld = (int)e[5], shift = (int)e[6];
    int group = blockIdx.x - (int)e[8];
#define MANY_GROUP(F) matvec_group<F, 1, 4, NT, XS>(W, S, rows, cols, sc_ld, shift, x, x_ld, \
                                                    rows, y, e[7], batch, KW, group, red, sx)
    if (fmt == 0)
        MANY_GROUP(Fp8);
    else if (fmt == 3)
        MANY_GROUP(Fp8h);
    else if (fmt == 1)
        MANY_GROUP(Fp4);
    else
        MANY_GROUP(Bf16);
#undef MANY_GROUP
}

// rows_many_n{NT}[_sx]: the _sx kernels take x through shared memory (stage_x in the format of
// the block's matrix; rows.py sizes it for the plan's largest).
#define MANY_ARGS const long long* __restrict__ table, int count, const float* __restrict__ x, \
    long long x_ld, int cols, int batch, int KW
#define MANY(NT, XS, SUFFIX) \
    extern "C" __global__ void __launch_bounds__(32 * RW) rows_many_n##NT##SUFFIX(MANY_ARGS) { \
        __shared__ float red[RW * 4 * 32]; \
        extern __shared__ __align__(16) u32 sx[]; \
        matvec_table<NT, XS>(table, count, x, x_ld, cols, batch, KW, red, sx); }
MANY(1, X_REGS, )
MANY(2, X_REGS, )
MANY(1, X_SHARED, _sx)
MANY(2, X_SHARED, _sx)

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
    wait_inputs();  // (pdl.py)
    decode_words<Fp8>(W, S, rows, cols, sc_ld, shift, out);
}
extern "C" __global__ void rows_decode_fp8h(DECODE_ARGS) {
    wait_inputs();  // (pdl.py)
    decode_words<Fp8h>(W, S, rows, cols, sc_ld, shift, out);
}
extern "C" __global__ void rows_decode_fp4(DECODE_ARGS) {
    wait_inputs();  // (pdl.py)
    decode_words<Fp4>(W, S, rows, cols, sc_ld, shift, out);
}
