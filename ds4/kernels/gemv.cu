// Matrix-vector products for decode: y = W x with W stored [rows, cols]. Weights are raw bfloat16
// words (uint16) or fp32; a bf16 word widens by a 16-bit shift into a float's high half, so bf16
// weights stay bf16 in device memory and every byte is read once, 16 bytes per load.

#include "common.cuh"

// One warp per row; grid.y splits the columns into `splits` equal spans (then y must be zeroed
// first and partial sums are added atomically). Row r reads x + (r / rows_per_group) * cols, which
// serves the grouped output projection (8 groups, each with its own input slice).
// Requires cols % (8 * splits) == 0.
template <typename W>
__device__ void gemv(const W* __restrict__ Wm, const float* __restrict__ x, float* __restrict__ y,
                     int rows, int cols, int rows_per_group, int splits) {
    int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (row >= rows) return;
    int span = cols / splits;
    size_t k0 = (size_t)blockIdx.y * span;
    const W* w = Wm + (size_t)row * cols + k0;
    const float4* xv = (const float4*)(x + (size_t)(row / rows_per_group) * cols + k0);
    float acc = row_dot(w, xv, span >> 3);
    if ((threadIdx.x & 31) == 0) {
        if (splits > 1) atomicAdd(y + row, acc);
        else y[row] = acc;
    }
}

// Two rows per warp, their loads interleaved: twice the bytes in flight per warp, which short
// rows (cols <= 2048: 4 or 8 loads per lane per row) need to keep HBM busy.
template <typename W>
__device__ void gemv2(const W* __restrict__ Wm, const float* __restrict__ x, float* __restrict__ y,
                      int rows, int cols, int rows_per_group) {
    int row = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * 2;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    int second = min(row + 1, rows - 1);
    const W* w0 = Wm + (size_t)row * cols;
    const W* w1 = Wm + (size_t)second * cols;
    const float4* x0 = (const float4*)(x + (size_t)(row / rows_per_group) * cols);
    const float4* x1 = (const float4*)(x + (size_t)(second / rows_per_group) * cols);
    int n8 = cols >> 3, i = lane;
    float a0 = 0.f, a1 = 0.f, b0 = 0.f, b1 = 0.f;
    for (; i + 32 < n8; i += 64) {
        Pack<W> p, q, r, s;
        p.load(w0, i); q.load(w0, i + 32); r.load(w1, i); s.load(w1, i + 32);
        a0 += p.dot(x0 + 2 * i);
        a1 += q.dot(x0 + 2 * (i + 32));
        b0 += r.dot(x1 + 2 * i);
        b1 += s.dot(x1 + 2 * (i + 32));
    }
    for (; i < n8; i += 32) {
        a0 += pack_dot(w0, x0, i);
        b0 += pack_dot(w1, x1, i);
    }
    float a = warp_sum(a0 + a1), b = warp_sum(b0 + b1);
    if (lane == 0) {
        y[row] = a;
        if (second != row) y[second] = b;
    }
}

extern "C" __global__ void gemv2_bf16(const unsigned short* __restrict__ W,
                                      const float* __restrict__ x, float* __restrict__ y,
                                      int rows, int cols, int rows_per_group) {
    wait_inputs();  // (pdl.py)
    gemv2(W, x, y, rows, cols, rows_per_group);
}

extern "C" __global__ void gemv2_f32(const float* __restrict__ W, const float* __restrict__ x,
                                     float* __restrict__ y, int rows, int cols,
                                     int rows_per_group) {
    wait_inputs();  // (pdl.py)
    gemv2(W, x, y, rows, cols, rows_per_group);
}

extern "C" __global__ void gemv_bf16(const unsigned short* __restrict__ W,
                                     const float* __restrict__ x, float* __restrict__ y,
                                     int rows, int cols, int rows_per_group, int splits) {
    wait_inputs();  // (pdl.py)
    gemv(W, x, y, rows, cols, rows_per_group, splits);
}

extern "C" __global__ void gemv_f32(const float* __restrict__ W, const float* __restrict__ x,
                                    float* __restrict__ y, int rows, int cols, int rows_per_group,
                                    int splits) {
    wait_inputs();  // (pdl.py)
    gemv(W, x, y, rows, cols, rows_per_group, splits);
}

// Several matrices that multiply the same x, in one launch: table[3 * k] = W_k pointer,
// table[3 * k + 1] = y_k pointer, table[3 * k + 2] = rows of W_k (all with `cols` columns).
// Warp g computes row g of the stacked rows. Decode reads a handful of small projections of one
// input (q_a, kv, both compressors, the indexer weights); apart, each is too small to fill the GPU.
template <typename W>
__device__ void gemv_many(const long long* __restrict__ table, int count, const float* x,
                          int cols) {
    int g = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int k = 0;
    while (k < count && g >= table[3 * k + 2]) { g -= (int)table[3 * k + 2]; k++; }
    if (k >= count) return;
    const W* w = (const W*)table[3 * k] + (size_t)g * cols;
    float acc = row_dot(w, (const float4*)x, cols >> 3);
    if ((threadIdx.x & 31) == 0) ((float*)table[3 * k + 1])[g] = acc;
}

extern "C" __global__ void gemv_many_bf16(const long long* __restrict__ table, int count,
                                          const float* __restrict__ x, int cols) {
    wait_inputs();  // (pdl.py)
    gemv_many<unsigned short>(table, count, x, cols);
}

extern "C" __global__ void gemv_many_f32(const long long* __restrict__ table, int count,
                                         const float* __restrict__ x, int cols) {
    wait_inputs();  // (pdl.py)
    gemv_many<float>(table, count, x, cols);
}
