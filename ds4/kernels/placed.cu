// Routed experts split over device memory and pinned, device-mapped host memory. The packed
// expert kernels of packed.cu address expert e at base + e * stride; here each layer has a
// table of device addresses instead, codes[e] and scales[e], so an expert can sit in either
// memory and be read in place (a mapped host expert travels over PCIe as it is read). A
// re-placement rewrites the tables between steps, so a captured decode graph stays valid.
// The row math (decoding, x staging, dot products) is packed.cu's own (packed.cuh).
//
// Host reads are slow (~51 GB/s over PCIe against ~4 TB/s resident), so the kernels start them
// first: a block orders the picks host experts first (host_first) and walks them in that order,
// so the host experts' gate_up items are in the first wave of the persistent grid and resident
// items fill the GPU around them, and each down warp issues its host rows' loads before the
// resident ones. The sum over picks is the same; only its order changes.

#include "common.cuh"
#include "packed.cuh"

// order[0..n) = the pick positions k, those whose expert is in host memory first (each group
// in k order); n <= 32 (the launchers check).
__device__ void host_first(const int* idx, const int* on_host, int n, int* order) {
    if (threadIdx.x == 0) {
        int j = 0;
        for (int k = 0; k < n; k++)
            if (on_host[idx[k]]) order[j++] = k;
        for (int k = 0; k < n; k++)
            if (!on_host[idx[k]]) order[j++] = k;
    }
    __syncthreads();
}

// gate_up: act[k, j] = silu(min(g_j, limit)) * clamp(u_j, +-limit) * wts[k] for expert idx[k];
// expert e's gate rows start at codes[e] (scales at scales[e]), its up rows up_w (up_s) bytes
// further on. Work item = (order[n], tile of WARPS * R rows j), a persistent grid whose first
// items are the host experts' (see host_first).
template <class F, int R>
__device__ void placed_gate_up(const long long* codes, const long long* scales,
                               const int* on_host, long long up_w, long long up_s,
                               const int* idx, const float* wts, const float* x, float* act,
                               int inter, int cols, int sc_ld, int shift, float limit,
                               int n_rows) {
    extern __shared__ float4 sx[];
    __shared__ int order[32];
    int chunks = cols / F::CODES, warp = threadIdx.x >> 5;
    stage_x<F>(x, 0, chunks, sx);
    host_first(idx, on_host, n_rows, order);  // its sync covers the staging too
    int tiles = (inter + WARPS * R - 1) / (WARPS * R);
    for (int item = blockIdx.x; item < n_rows * tiles; item += gridDim.x) {
        int n = item / tiles, k = order[n], j0 = ((item - n * tiles) * WARPS + warp) * R;
        if (j0 >= inter) continue;
        int e = idx[k];
        const u8* gate = (const u8*)codes[e];
        const u8* gate_s = (const u8*)scales[e];
        RowSet<F, 2 * R> rs;
        float acc[2 * R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            int r = min(j0 + j, inter - 1);
            rs.set(2 * j, gate, gate_s, r, cols, sc_ld, shift);
            rs.set(2 * j + 1, gate + up_w, gate_s + up_s, r, cols, sc_ld, shift);
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
            act[(size_t)k * inter + j0 + j] = gs / (1.f + expf(-gs)) * us * wts[k];
        }
    }
}

// down: y[r] (+)= sum_k down_{idx[k]}[r] . act[k] over the n_sel experts in one warp, as
// packed_down does, with expert e's rows at codes[e] and scales at scales[e]; a warp walks the
// picks host experts first (their loads go out before the resident ones').
template <class F, int R>
__device__ void placed_down(const long long* codes, const long long* scales, const int* on_host,
                            const int* idx, const float* act, float* y, int rows, int inter,
                            int sc_ld, int shift, int n_sel, int accumulate) {
    extern __shared__ float4 sx[];
    __shared__ int order[32];
    int chunks = inter / F::CODES, warp = threadIdx.x >> 5;
    stage_x<F>(act, 0, n_sel * chunks, sx);
    host_first(idx, on_host, n_sel, order);
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
            int kk = order[k], e = idx[kk];
            const u8* w_e = (const u8*)codes[e];
            const u8* s_e = (const u8*)scales[e];
            uint4 w[R];
            float sc[R];
#pragma unroll
            for (int j = 0; j < R; j++) {
                int r = min(r0 + j, rows - 1);
                const u8* row = w_e + (size_t)r * F::row_bytes(inter);
                w[j] = __ldcs((const uint4*)row + i);
                sc[j] = e8m0(__ldg(F::scale_row(s_e, r, sc_ld, shift) + F::scale_col(i, shift)))
                        * F::UNIT;
            }
            float xr[F::CODES];
            xs.template load<F>(kk * chunks + i, xr);
#pragma unroll
            for (int j = 0; j < R; j++) acc[j] = fmaf(dot_chunk<F>(w[j], xr), sc[j], acc[j]);
            for (i += 32; i >= chunks; i -= chunks) k++;
        }
        store_rows<R>(acc, y, r0, rows, false, accumulate);
    }
}

// counts[idx[k]] += 1 for the k experts a decode step picked (re-placement reads them), unless
// the token is an idle row of a batch graph (member >= *live, live non-null).
extern "C" __global__ void count_picks(const int* __restrict__ idx, int k, int* counts,
                                       const int* __restrict__ live, int member) {
    wait_inputs();  // (pdl.py)
    if (threadIdx.x < k && (!live || member < *live)) atomicAdd(counts + idx[threadIdx.x], 1);
}

#define PLACED_GATE_UP_ARGS const long long* __restrict__ codes, \
    const long long* __restrict__ scales, const int* __restrict__ on_host, long long up_w, \
    long long up_s, \
    const int* __restrict__ idx, const float* __restrict__ wts, const float* __restrict__ x, \
    float* act, int inter, int cols, int sc_ld, int shift, float limit, int n_rows
#define PLACED_DOWN_ARGS const long long* __restrict__ codes, \
    const long long* __restrict__ scales, const int* __restrict__ on_host, \
    const int* __restrict__ idx, \
    const float* __restrict__ act, float* y, int rows, int inter, int sc_ld, int shift, \
    int n_sel, int accumulate
#define PLACED(fmt, F, R) \
    extern "C" __global__ void placed_gate_up_##fmt##_r##R(PLACED_GATE_UP_ARGS) { \
        wait_inputs(); \
        placed_gate_up<F, R>(codes, scales, on_host, up_w, up_s, idx, wts, x, act, inter, cols, \
                             sc_ld, shift, limit, n_rows); } \
    extern "C" __global__ void placed_down_##fmt##_r##R(PLACED_DOWN_ARGS) { \
        wait_inputs(); \
        placed_down<F, R>(codes, scales, on_host, idx, act, y, rows, inter, sc_ld, shift, n_sel, \
                          accumulate); }

PLACED(fp8, Fp8, 1)
PLACED(fp4, Fp4, 1)
