// RMSNorm in fp32 (docs/MODEL.md, Numerics): out = x * rsqrt(mean(x^2) + eps) * w, a block per row.

#include "common.cuh"

// x and out are [rows, n]; w is [n] or null (the unweighted per-head norm). out may alias x.
extern "C" __global__ void rms_norm(const float* x, const float* __restrict__ w, float* out,
                                    int n, float eps) {
    __shared__ float shared[32];
    const float* xr = x + (size_t)blockIdx.x * n;
    float* yr = out + (size_t)blockIdx.x * n;
    float ss = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    float r = rsqrtf(block_sum(ss, shared) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * r * (w ? w[i] : 1.f);
}
