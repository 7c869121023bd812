// bf16-weight matrix-vector products for decode: y = W x with W stored [rows, cols] as raw
// bfloat16 words (uint16). Widening a bf16 word is a 16-bit shift into a float's high half, so
// the weights stay bf16 in device memory and each byte is read once, 16 bytes per load.

__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float dot8(uint4 w, const float4* x) {
    float4 a = x[0], b = x[1];
    return bf16_lo(w.x) * a.x + bf16_hi(w.x) * a.y + bf16_lo(w.y) * a.z + bf16_hi(w.y) * a.w
         + bf16_lo(w.z) * b.x + bf16_hi(w.z) * b.y + bf16_lo(w.w) * b.z + bf16_hi(w.w) * b.w;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One warp per row; grid.y splits the columns into `splits` equal spans (then y must be zeroed
// first and partial sums are added atomically). Row r reads x + (r / rows_per_group) * cols, which
// serves the grouped output projection (8 groups, each with its own input slice).
// Requires cols % (8 * splits) == 0.
extern "C" __global__ void gemv_bf16(const unsigned short* __restrict__ W,
                                     const float* __restrict__ x, float* __restrict__ y,
                                     int rows, int cols, int rows_per_group, int splits) {
    int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    int span = cols / splits;
    size_t k0 = (size_t)blockIdx.y * span;
    const uint4* w = (const uint4*)(W + (size_t)row * cols + k0);
    const float4* xv = (const float4*)(x + (size_t)(row / rows_per_group) * cols + k0);
    int n8 = span >> 3;
    float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f, acc3 = 0.f;
    int i = lane;
    // Four independent 16-byte loads in flight per lane before the first use.
    for (; i + 96 < n8; i += 128) {
        uint4 a = __ldcs(w + i), b = __ldcs(w + i + 32), c = __ldcs(w + i + 64), d = __ldcs(w + i + 96);
        acc0 += dot8(a, xv + 2 * i);
        acc1 += dot8(b, xv + 2 * (i + 32));
        acc2 += dot8(c, xv + 2 * (i + 64));
        acc3 += dot8(d, xv + 2 * (i + 96));
    }
    for (; i < n8; i += 32) acc0 += dot8(__ldcs(w + i), xv + 2 * i);
    float acc = warp_sum((acc0 + acc1) + (acc2 + acc3));
    if (lane == 0) {
        if (splits > 1) atomicAdd(y + row, acc);
        else y[row] = acc;
    }
}

// Same product for fp32 weights (router-free small matrices kept fp32 by the checkpoint).
extern "C" __global__ void gemv_f32(const float* __restrict__ W, const float* __restrict__ x,
                                    float* __restrict__ y, int rows, int cols) {
    int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float* w = W + (size_t)row * cols;
    float acc = 0.f;
    for (int k = lane; k < cols; k += 32) acc += w[k] * x[k];
    acc = warp_sum(acc);
    if (lane == 0) y[row] = acc;
}
