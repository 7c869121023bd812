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
#include "packed.cuh"

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
