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
