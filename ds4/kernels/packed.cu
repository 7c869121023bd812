// Packed weights read in place: FP8 E4M3 codes with E8M0 block scales (one scale per B x B
// block, B = the checkpoint's weight_block_size, a power of two) and MXFP4 E2M1 codes, two per
// byte (low nibble = even column), with one E8M0 scale per 32 columns of a row.
//
// Decode GEMVs turn a 16-byte load into halves with a few instructions per pair of codes (the
// hardware e4m3x2 -> f16x2 conversion; for E2M1 a shift-and-mask that lands each nibble in a
// half's sign, exponent and mantissa bits, exact up to a constant 2^-14), widen the halves to
// fp32 and accumulate in fp32 against fp32 x: every product is exact, as in the NumPy twin.
// Each lane holds one 16-byte chunk of R rows at a time, so one load of x serves R rows, and a
// chunk lies inside one scale block, so its scale is applied once per chunk.
// Prefill kernels widen a slab of rows into bf16 words for the tensor-core GEMMs (exact: every
// dequantized value has at most four significant bits).

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

// y[b * y_ld + r] (+)= W[r] . x_b. Split blockIdx.y covers its span of columns (splits > 1:
// partial sums added atomically onto a zeroed or accumulating y). Row r reads
// x_b + (r / rows_per_group) * cols (the grouped output projection; FP8 only).
// FP8, NB == 1: warp g takes rows g*R ..; x from global memory.
// FP4, NB == 1: x span staged once per block (dynamic shared memory, x_bytes), the block's warps
// loop over row tiles tile = blockIdx.x, + gridDim.x, ... (warp w: rows (tile*WARPS + w)*R ..).
// NB > 1: x from global memory, each decoded chunk meets every x_b.
template <class F, int R, int NB>
__device__ void packed_gemv(const u8* __restrict__ W, const u8* __restrict__ S, int rows,
                            int cols, int sc_ld, int shift, const float* __restrict__ x,
                            long long x_ld, int rows_per_group, float* y, long long y_ld, int nb,
                            int splits, int accumulate) {
    int span = cols / F::CODES / splits, c0 = blockIdx.y * span, warp = threadIdx.x >> 5;
    if constexpr (NB == 1 && F::CODES == 32) {
        extern __shared__ float4 sx[];
        stage_x<F>(x, c0, span, sx);
        __syncthreads();
        int tiles = (rows + WARPS * R - 1) / (WARPS * R);
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int row0 = (tile * WARPS + warp) * R;
            if (row0 >= rows) break;
            float acc[R];
#pragma unroll
            for (int j = 0; j < R; j++) acc[j] = 0.f;
            RowSet<F, R> rs(W, S, row0, rows, cols, sc_ld, shift);
            rows_dot<F, R>(rs, SharedX{sx, c0}, c0, c0 + span, shift, acc);
            store_rows<R>(acc, y, row0, rows, splits > 1, accumulate);
        }
    } else {
        int row0 = (blockIdx.x * WARPS + warp) * R;
        if (row0 >= rows) return;
        RowSet<F, R> rs(W, S, row0, rows, cols, sc_ld, shift);
        const float* xg = x + (size_t)(row0 / rows_per_group) * cols;
        if constexpr (NB == 1) {
            float acc[R];
#pragma unroll
            for (int j = 0; j < R; j++) acc[j] = 0.f;
            rows_dot<F, R>(rs, GlobalX{xg}, c0, c0 + span, shift, acc);
            store_rows<R>(acc, y, row0, rows, splits > 1, accumulate);
        } else {
            float acc[R][NB];
#pragma unroll
            for (int j = 0; j < R; j++)
#pragma unroll
                for (int b = 0; b < NB; b++) acc[j][b] = 0.f;
            rows_dot_batch<F, R, NB>(rs, xg, x_ld, nb, c0, c0 + span, shift, acc);
#pragma unroll
            for (int b = 0; b < NB; b++) {
                if (b >= nb) break;
                float a[R];
#pragma unroll
                for (int j = 0; j < R; j++) a[j] = acc[j][b];
                store_rows<R>(a, y + b * y_ld, row0, rows, splits > 1, accumulate);
            }
        }
    }
}

#define GEMV_ARGS const u8* __restrict__ W, const u8* __restrict__ S, int rows, int cols, \
    int sc_ld, int shift, const float* __restrict__ x, long long x_ld, int rows_per_group, \
    float* y, long long y_ld, int nb, int splits, int accumulate
#define GEMV_CALL W, S, rows, cols, sc_ld, shift, x, x_ld, rows_per_group, y, y_ld, nb, splits, \
    accumulate
#define GEMV(name, F, R, NB) \
    extern "C" __global__ void name(GEMV_ARGS) { packed_gemv<F, R, NB>(GEMV_CALL); }

GEMV(gemv_fp8_r1, Fp8, 1, 1)
GEMV(gemv_fp8_r2, Fp8, 2, 1)
GEMV(gemv_fp8_r4, Fp8, 4, 1)
GEMV(gemv_fp4_r1, Fp4, 1, 1)
GEMV(gemv_fp4_r2, Fp4, 2, 1)
GEMV(gemv_fp4_r4, Fp4, 4, 1)
GEMV(gemv_fp8_b8, Fp8, 2, 8)
GEMV(gemv_fp4_b8, Fp4, 2, 8)

// Several FP8 matrices that multiply the same x (decode's small projections of one input), in
// one launch: table[4 * m ..] = (codes, scales, y, rows) of matrix m, all with `cols` columns
// and block 2^shift. Warp g computes rows 2g', 2g' + 1 of the matrix it falls in.
extern "C" __global__ void gemv_many_fp8(const long long* __restrict__ table, int count,
                                         const float* __restrict__ x, int cols, int shift) {
    int g = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, m = 0;
    for (; m < count; m++) {
        int warps = (int)((table[4 * m + 3] + 1) / 2);
        if (g < warps) break;
        g -= warps;
    }
    if (m >= count) return;
    int rows = (int)table[4 * m + 3], row0 = 2 * g;
    int sc_ld = ((cols - 1) >> shift) + 1;
    RowSet<Fp8, 2> rs((const u8*)table[4 * m], (const u8*)table[4 * m + 1], row0, rows, cols,
                      sc_ld, shift);
    float acc[2] = {0.f, 0.f};
    rows_dot<Fp8, 2>(rs, GlobalX{x}, 0, cols / Fp8::CODES, shift, acc);
    float* y = (float*)table[4 * m + 2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        float v = warp_sum(acc[j]);
        if ((threadIdx.x & 31) == 0 && row0 + j < rows) y[row0 + j] = v;
    }
}

// Routed experts of one token (experts stacked [E, rows, ...], expert e at e * w_stride bytes
// and e * s_stride scale bytes). x (gate_up) or act (down) is staged in shared memory once per
// block (x_bytes), and the block's warps loop over row tiles (a persistent grid).
// gate_up: act[k, j] = silu(min(g_j, limit)) * clamp(u_j, +-limit) * wts[k] for expert idx[k]
// (idx null: expert k; wts null: weight 1), work item = (k, tile of WARPS * R rows j).
// limit <= 0 turns the clamps off.
template <class F, int R>
__device__ void packed_gate_up(const u8* gate, const u8* gate_s, const u8* up, const u8* up_s,
                               long long w_stride, long long s_stride, const int* idx,
                               const float* wts, const float* x, float* act, int inter,
                               int cols, int sc_ld, int shift, float limit, int n_rows) {
    extern __shared__ float4 sx[];
    int chunks = cols / F::CODES, warp = threadIdx.x >> 5;
    stage_x<F>(x, 0, chunks, sx);
    __syncthreads();
    int tiles = (inter + WARPS * R - 1) / (WARPS * R);
    for (int item = blockIdx.x; item < n_rows * tiles; item += gridDim.x) {
        int k = item / tiles, j0 = ((item - k * tiles) * WARPS + warp) * R;
        if (j0 >= inter) continue;
        long long e = idx ? idx[k] : k;
        float wk = wts ? wts[k] : 1.f;
        // gate and up rows in one row set: twice the loads in flight, one read of x for both
        RowSet<F, 2 * R> rs;
        float acc[2 * R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            int r = min(j0 + j, inter - 1);
            rs.set(2 * j, gate + e * w_stride, gate_s + e * s_stride, r, cols, sc_ld, shift);
            rs.set(2 * j + 1, up + e * w_stride, up_s + e * s_stride, r, cols, sc_ld, shift);
            acc[2 * j] = acc[2 * j + 1] = 0.f;
        }
        rows_dot<F, 2 * R>(rs, SharedX{sx, 0}, 0, chunks, shift, acc);
#pragma unroll
        for (int j = 0; j < R; j++) {
            float gs = warp_sum(acc[2 * j]), us = warp_sum(acc[2 * j + 1]);
            if ((threadIdx.x & 31) != 0 || j0 + j >= inter) continue;
            if (limit > 0.f) {
                gs = fminf(gs, limit);
                us = fminf(fmaxf(us, -limit), limit);
            }
            act[(size_t)k * inter + j0 + j] = gs / (1.f + expf(-gs)) * us * wk;
        }
    }
}

// down: y[r] (+)= sum_k down_{idx[k]}[r] . act[k] over the n_sel experts, all of them in one
// warp (no atomics); act [n_sel, inter] staged. A lane walks the experts' chunks as one flat
// range f = k * chunks + i, so the loads of several experts are in flight together (one
// expert's row of 2048 codes is only two chunks per lane).
template <class F, int R>
__device__ void packed_down(const u8* down, const u8* down_s, long long w_stride,
                            long long s_stride, const int* idx, const float* act, float* y,
                            int rows, int inter, int sc_ld, int shift, int n_sel,
                            int accumulate) {
    extern __shared__ float4 sx[];
    int chunks = inter / F::CODES, warp = threadIdx.x >> 5;
    stage_x<F>(act, 0, n_sel * chunks, sx);
    __syncthreads();
    int tiles = (rows + WARPS * R - 1) / (WARPS * R);
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int r0 = (tile * WARPS + warp) * R;
        if (r0 >= rows) break;
        float acc[R];
#pragma unroll
        for (int j = 0; j < R; j++) acc[j] = 0.f;
        int lane = threadIdx.x & 31, k = lane / chunks, i = lane - k * chunks;
        SharedX xs{sx, 0};
#pragma unroll 4
        for (int f = lane; f < n_sel * chunks; f += 32) {
            long long e = idx ? idx[k] : k;
            uint4 w[R];
            float sc[R];
#pragma unroll
            for (int j = 0; j < R; j++) {
                int r = min(r0 + j, rows - 1);
                const u8* row = down + e * w_stride + (size_t)r * F::row_bytes(inter);
                w[j] = __ldcs((const uint4*)row + i);
                sc[j] = e8m0(__ldg(F::scale_row(down_s + e * s_stride, r, sc_ld, shift)
                                   + F::scale_col(i, shift))) * F::UNIT;
            }
            float xr[F::CODES];
            xs.template load<F>(f, xr);
#pragma unroll
            for (int j = 0; j < R; j++) acc[j] = fmaf(dot_chunk<F>(w[j], xr), sc[j], acc[j]);
            for (i += 32; i >= chunks; i -= chunks) k++;
        }
        store_rows<R>(acc, y, r0, rows, false, accumulate);
    }
}

#define GATE_UP_ARGS const u8* __restrict__ gate, const u8* __restrict__ gate_s, \
    const u8* __restrict__ up, const u8* __restrict__ up_s, long long w_stride, \
    long long s_stride, const int* __restrict__ idx, const float* __restrict__ wts, \
    const float* __restrict__ x, float* act, int inter, int cols, int sc_ld, int shift, \
    float limit, int n_rows
#define GATE_UP_CALL gate, gate_s, up, up_s, w_stride, s_stride, idx, wts, x, act, inter, cols, \
    sc_ld, shift, limit, n_rows
#define DOWN_ARGS const u8* __restrict__ down, const u8* __restrict__ down_s, long long w_stride, \
    long long s_stride, const int* __restrict__ idx, const float* __restrict__ act, float* y, \
    int rows, int inter, int sc_ld, int shift, int n_sel, int accumulate
#define DOWN_CALL down, down_s, w_stride, s_stride, idx, act, y, rows, inter, sc_ld, shift, \
    n_sel, accumulate
#define MOE(fmt, F, R) \
    extern "C" __global__ void moe_gate_up_##fmt##_r##R(GATE_UP_ARGS) { \
        packed_gate_up<F, R>(GATE_UP_CALL); } \
    extern "C" __global__ void moe_down_##fmt##_r##R(DOWN_ARGS) { packed_down<F, R>(DOWN_CALL); }

MOE(fp8, Fp8, 1)
MOE(fp8, Fp8, 2)
MOE(fp8, Fp8, 4)
MOE(fp4, Fp4, 1)
MOE(fp4, Fp4, 2)
MOE(fp4, Fp4, 4)

// Prefill: rows [row0, row0 + nrows) of a packed matrix as bf16 words out [nrows, cols], one
// 16-byte chunk of codes per thread and step. bf16 keeps the top half of the fp32 value, which
// is exact here (at most four significant bits).
template <class F>
__device__ void dequant_bf16(const u8* __restrict__ W, const u8* __restrict__ S, int cols,
                             int sc_ld, int shift, int row0, int nrows, unsigned short* out) {
    int per_row = cols / F::CODES;
    long long n = (long long)nrows * per_row;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < n;
         t += (long long)gridDim.x * blockDim.x) {
        int r = (int)(t / per_row), i = (int)(t - (long long)r * per_row);
        const u8* w = W + (size_t)(row0 + r) * F::row_bytes(cols);
        float s = e8m0(F::scale_row(S, row0 + r, sc_ld, shift)[F::scale_col(i, shift)]) * F::UNIT;
        float f[F::CODES];
        F::decode(__ldcs((const uint4*)w + i), f);
        uint4* o = (uint4*)(out + (size_t)r * cols + (size_t)i * F::CODES);
#pragma unroll
        for (int k = 0; k < F::CODES / 8; k++) {
            unsigned int p[4];
#pragma unroll
            for (int m = 0; m < 4; m++)
                p[m] = __byte_perm(__float_as_uint(f[8 * k + 2 * m] * s),
                                   __float_as_uint(f[8 * k + 2 * m + 1] * s), 0x7632);
            o[k] = make_uint4(p[0], p[1], p[2], p[3]);
        }
    }
}

#define DEQUANT_ARGS const u8* __restrict__ W, const u8* __restrict__ S, int cols, int sc_ld, \
    int shift, int row0, int nrows, unsigned short* out
extern "C" __global__ void dequant_fp8_bf16(DEQUANT_ARGS) {
    dequant_bf16<Fp8>(W, S, cols, sc_ld, shift, row0, nrows, out);
}
extern "C" __global__ void dequant_fp4_bf16(DEQUANT_ARGS) {
    dequant_bf16<Fp4>(W, S, cols, sc_ld, shift, row0, nrows, out);
}
