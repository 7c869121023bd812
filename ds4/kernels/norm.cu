// RMSNorm in fp32 (spec 6.1): out = x * rsqrt(mean(x^2) + eps) * w, one block per row.

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum of v over the block; every thread gets the result. `shared` holds 32 floats.
__device__ float block_sum(float v, float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float t = (threadIdx.x < (blockDim.x + 31) / 32) ? shared[threadIdx.x] : 0.f;
    if (warp == 0) t = warp_sum(t);
    if (threadIdx.x == 0) shared[0] = t;
    __syncthreads();
    return shared[0];
}

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
