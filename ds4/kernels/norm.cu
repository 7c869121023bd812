// RMSNorm in fp32 (docs/MODEL.md, Numerics): out = x * rsqrt(mean(x^2) + eps) * w, a block per row.

#include "common.cuh"

// x and out are [rows, n]; w is [n] or null (the unweighted per-head norm). out may alias x.
extern "C" __global__ void rms_norm(const float* x, const float* __restrict__ w, float* out,
                                    int n, float eps) {
    wait_inputs();  // (pdl.py)
    __shared__ float shared[32];
    const float* xr = x + (size_t)blockIdx.x * n;
    float* yr = out + (size_t)blockIdx.x * n;
    float ss = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    float r = rsqrtf(block_sum(ss, shared) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * r * (w ? w[i] : 1.f);
}

// rms_norm with one warp a row, for rows of n <= 4 * 32 * WARP_PIECES floats, n % 4 == 0 and
// 16-byte aligned rows: float4 loads held in registers and a shuffle sum, no block barrier.
// Prefill's norms are many short rows (a 2048-token chunk's per-head query norm: 131072 rows
// of 512), where a block a row spent its time in the barrier of block_sum. Same products as
// rms_norm; the sum of squares adds in another order.
#define WARP_PIECES 16
extern "C" __global__ void rms_norm_warp(const float* x, const float* __restrict__ w, float* out,
                                         int rows, int n, float eps) {
    wait_inputs();  // (pdl.py)
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float4* xr = (const float4*)(x + (size_t)row * n);
    float4* yr = (float4*)(out + (size_t)row * n);
    int n4 = n >> 2;
    float4 v[WARP_PIECES];
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < WARP_PIECES; u++) {
        int i = lane + u * 32;
        if (i < n4) {
            v[u] = xr[i];
            ss += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
        }
    }
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    float r = rsqrtf(ss / n + eps);
#pragma unroll
    for (int u = 0; u < WARP_PIECES; u++) {
        int i = lane + u * 32;
        if (i < n4) {
            float4 g = w ? ((const float4*)w)[i] : make_float4(1.f, 1.f, 1.f, 1.f);
            yr[i] = make_float4(v[u].x * r * g.x, v[u].y * r * g.y, v[u].z * r * g.z,
                                v[u].w * r * g.w);
        }
    }
}

// rms_norm of each row of x [rows, n] in place (w null: unweighted), then RoPE of its trailing
// rope_dim channels at position pos[row / rows_per_pos]: the decode query's per-head norm and
// rotation in one launch. Same arithmetic as rms_norm followed by rope_tail (rope.cu).
extern "C" __global__ void rms_norm_rope(float* x, const float* __restrict__ w, int n, float eps,
                                         const int* __restrict__ pos,
                                         const double* __restrict__ freqs, int rope_dim,
                                         int rows_per_pos) {
    wait_inputs();  // (pdl.py)
    __shared__ float shared[32];
    extern __shared__ float row[];
    float* xr = x + (size_t)blockIdx.x * n;
    float ss = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    float r = rsqrtf(block_sum(ss, shared) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) row[i] = xr[i] * r * (w ? w[i] : 1.f);
    __syncthreads();
    double t = (double)pos[blockIdx.x / rows_per_pos];
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        xr[i] = rope_channel(row, i, n - rope_dim, t, freqs);
}
