// Single-query attention for decode (spec 3.4, 3.7): one shared K=V head, per-head sinks,
// keys = the raw sliding window ring plus compressed rows (all of them, or an indexer selection).

#ifndef INFINITY  // NVRTC has no math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reduction (op 0 = sum, 1 = max); every thread gets the result.
__device__ float block_reduce(float v, float* shared, int op) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) / 32;
    v = op ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float t = threadIdx.x < nw ? shared[threadIdx.x] : (op ? -INFINITY : 0.f);
    if (warp == 0) t = op ? warp_max(t) : warp_sum(t);
    if (threadIdx.x == 0) shared[0] = t;
    __syncthreads();
    return shared[0];
}

// The new K=V row: raw[pos % cap] = rope(RMSNorm_w(kv_in)) at position pos. One block of
// `width` threads (width <= 1024).
extern "C" __global__ void attention_store_kv(const float* __restrict__ kv_in,
                                              const float* __restrict__ w,
                                              const double* __restrict__ freqs,
                                              const int* __restrict__ pos, float* raw, int width,
                                              int rope_dim, int cap, float eps) {
    __shared__ float red[32];
    extern __shared__ float row[];
    int c = threadIdx.x;
    float v = c < width ? kv_in[c] : 0.f;
    float r = rsqrtf(block_reduce(v * v, red, 0) / width + eps);
    if (c < width) row[c] = v * r * w[c];
    __syncthreads();
    int t = pos[0];
    int first = width - rope_dim;
    if (c < width) {
        float out = row[c];
        if (c >= first) {
            int k = (c - first) >> 1;
            double ds, dc;
            sincos((double)t * freqs[k], &ds, &dc);
            float s = (float)ds, co = (float)dc;
            float a = row[first + 2 * k], b = row[first + 2 * k + 1];
            out = ((c - first) & 1) ? a * s + b * co : a * co - b * s;
        }
        raw[(size_t)(t % cap) * width + c] = out;
    }
}

// Key j's row: ring row j for j < n_raw, else compressed row sel[j - n_raw] (or j - n_raw).
__device__ __forceinline__ int key_code(int j, int n_raw, const int* sel) {
    if (j < n_raw) return -(j + 1);
    j -= n_raw;
    return sel ? sel[j] : j;
}

__device__ __forceinline__ const float* key_ptr(int code, const float* raw, const float* comp,
                                                int width) {
    return code < 0 ? raw + (size_t)(-code - 1) * width : comp + (size_t)code * width;
}

// out[h] = sum_j p_j k_j, p = softmax over the keys with the sink's exp(sinks[h]) in the
// denominator. Raw keys: min(pos + 1, cap) ring rows. Compressed keys: none when ratio == 0,
// else sel[0..sel_count) when sel is given, else rows 0..(pos + 1) / ratio. One block per head
// (width <= 1024); dynamic shared memory holds max_keys scores and max_keys row codes. The value
// pass keeps 8 key rows in flight per thread: it is L2-latency bound otherwise.
extern "C" __global__ void attention_decode(const float* __restrict__ q,
                                            const float* __restrict__ raw,
                                            const int* __restrict__ pos, int cap,
                                            const float* __restrict__ comp,
                                            const int* __restrict__ sel,
                                            const int* __restrict__ sel_count, int ratio,
                                            const float* __restrict__ sinks, float* out,
                                            int width, float scale, int max_keys) {
    __shared__ float red[32];
    extern __shared__ float smem[];
    float* scores = smem;
    int* codes = (int*)(smem + max_keys);
    int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int nw = blockDim.x >> 5;
    int t = pos[0];
    int n_raw = min(t + 1, cap);
    int n_comp = ratio == 0 ? 0 : (sel ? sel_count[0] : (t + 1) / ratio);
    int n = min(n_raw + n_comp, max_keys);
    const float* qh = q + (size_t)h * width;
    float qr[32];
#pragma unroll
    for (int i = 0; i < 32; i++) qr[i] = lane + 32 * i < width ? qh[lane + 32 * i] : 0.f;
    for (int j = warp; j < n; j += nw) {
        int code = key_code(j, n_raw, sel);
        const float* k = key_ptr(code, raw, comp, width);
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (lane + 32 * i < width) acc += qr[i] * k[lane + 32 * i];
        acc = warp_sum(acc);
        if (lane == 0) { scores[j] = acc * scale; codes[j] = code; }
    }
    __syncthreads();
    float m = sinks[h];
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, scores[j]);
    m = block_reduce(m, red, 1);
    float s = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += (scores[j] = expf(scores[j] - m));
    float denom = block_reduce(s, red, 0) + expf(sinks[h] - m);
    float inv = 1.f / denom;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        int j = 0;
        for (; j + 8 <= n; j += 8) {
            float k[8];
#pragma unroll
            for (int u = 0; u < 8; u++) k[u] = key_ptr(codes[j + u], raw, comp, width)[c];
#pragma unroll
            for (int u = 0; u < 8; u++) a[u] += scores[j + u] * k[u];
        }
        for (; j < n; j++) a[0] += scores[j] * key_ptr(codes[j], raw, comp, width)[c];
        out[(size_t)h * width + c] = (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))) * inv;
    }
}
