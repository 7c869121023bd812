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

// Flash-decoding split: block (h, s) takes keys [s * chunk, (s + 1) * chunk) of head h and
// writes its partial max m, sum l = sum exp(l_j - m) and o = sum exp(l_j - m) k_j into
// part[(h * splits + s) * (width + 2)] as [m, l, o...]. Raw keys: min(pos + 1, cap) ring rows;
// compressed keys: none when ratio == 0, else sel[0..sel_count) when sel is given, else rows
// 0..(pos + 1) / ratio. Dynamic shared memory: chunk scores and chunk row codes. Splitting the
// keys over blocks keeps the whole GPU busy; one block per head was L2-latency bound.
extern "C" __global__ void attention_partial(const float* __restrict__ q,
                                             const float* __restrict__ raw,
                                             const int* __restrict__ pos, int cap,
                                             const float* __restrict__ comp,
                                             const int* __restrict__ sel,
                                             const int* __restrict__ sel_count, int ratio,
                                             float* part, int width, float scale, int max_keys,
                                             int chunk) {
    __shared__ float red[32];
    extern __shared__ float smem[];
    float* scores = smem;
    int* codes = (int*)(smem + chunk);
    int h = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int t = pos[0];
    int n_raw = min(t + 1, cap);
    int n_comp = ratio == 0 ? 0 : (sel ? sel_count[0] : (t + 1) / ratio);
    int n = min(n_raw + n_comp, max_keys);
    int first = split * chunk, count = max(0, min(chunk, n - first));
    float* dst = part + ((size_t)h * splits + split) * (width + 2);
    const float* qh = q + (size_t)h * width;
    float qr[32];
#pragma unroll
    for (int i = 0; i < 32; i++) qr[i] = lane + 32 * i < width ? qh[lane + 32 * i] : 0.f;
    for (int j = warp; j < count; j += nw) {
        int code = key_code(first + j, n_raw, sel);
        const float* k = key_ptr(code, raw, comp, width);
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (lane + 32 * i < width) acc += qr[i] * k[lane + 32 * i];
        acc = warp_sum(acc);
        if (lane == 0) { scores[j] = acc * scale; codes[j] = code; }
    }
    __syncthreads();
    float m = -INFINITY;
    for (int j = threadIdx.x; j < count; j += blockDim.x) m = fmaxf(m, scores[j]);
    m = block_reduce(m, red, 1);
    float s = 0.f;
    for (int j = threadIdx.x; j < count; j += blockDim.x) s += (scores[j] = expf(scores[j] - m));
    s = block_reduce(s, red, 0);
    if (threadIdx.x == 0) { dst[0] = m; dst[1] = s; }
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        int j = 0;
        for (; j + 8 <= count; j += 8) {
            float k[8];
#pragma unroll
            for (int u = 0; u < 8; u++) k[u] = key_ptr(codes[j + u], raw, comp, width)[c];
#pragma unroll
            for (int u = 0; u < 8; u++) a[u] += scores[j + u] * k[u];
        }
        for (; j < count; j++) a[0] += scores[j] * key_ptr(codes[j], raw, comp, width)[c];
        dst[2 + c] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
}

// out[h] = (sum_s exp(m_s - M) o_s) / (exp(sink_h - M) + sum_s exp(m_s - M) l_s), M the largest
// of sink_h and the m_s: softmax over all keys with the sink's mass in the denominator.
extern "C" __global__ void attention_combine(const float* __restrict__ part,
                                             const float* __restrict__ sinks, float* out,
                                             int width, int splits) {
    int h = blockIdx.x;
    const float* p = part + (size_t)h * splits * (width + 2);
    float M = sinks[h];
    for (int s = 0; s < splits; s++) M = fmaxf(M, p[(size_t)s * (width + 2)]);
    float L = expf(sinks[h] - M);
    for (int s = 0; s < splits; s++) {
        float ms = p[(size_t)s * (width + 2)];
        if (ms > -INFINITY) L += expf(ms - M) * p[(size_t)s * (width + 2) + 1];
    }
    float inv = 1.f / L;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < splits; s++) {
            const float* ps = p + (size_t)s * (width + 2);
            if (ps[0] > -INFINITY) acc += expf(ps[0] - M) * ps[2 + c];
        }
        out[(size_t)h * width + c] = acc * inv;
    }
}
