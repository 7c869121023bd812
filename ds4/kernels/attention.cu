// Single-query attention for decode (docs/MODEL.md, Attention): one shared K=V head, head sinks,
// keys = the raw sliding window ring plus compressed rows (all of them, or an indexer selection).

#include "common.cuh"

// The new K=V row: raw[pos % cap] = rope(RMSNorm_w(kv_in)) at position pos. One block of
// `width` threads (width <= 1024).
__device__ __forceinline__ void store_kv(const float* __restrict__ kv_in,
                                         const float* __restrict__ w,
                                         const double* __restrict__ freqs,
                                         const int* __restrict__ pos, float* raw, int width,
                                         int rope_dim, int cap, float eps) {
    __shared__ float red[32];
    extern __shared__ float row[];
    int c = threadIdx.x;
    float v = c < width ? kv_in[c] : 0.f;
    float r = rsqrtf(block_sum(v * v, red) / width + eps);
    if (c < width) row[c] = v * r * w[c];
    __syncthreads();
    int t = pos[0];
    if (c < width)
        raw[(size_t)(t % cap) * width + c] = rope_channel(row, c, width - rope_dim, t, freqs);
}

extern "C" __global__ void attention_store_kv(const float* __restrict__ kv_in,
                                              const float* __restrict__ w,
                                              const double* __restrict__ freqs,
                                              const int* __restrict__ pos, float* raw, int width,
                                              int rope_dim, int cap, float eps) {
    wait_inputs();  // (pdl.py)
    store_kv(kv_in, w, freqs, pos, raw, width, rope_dim, cap, eps);
}

// A batch graph's members, docs/PERF.md, Batched decode: every decoding slot in one engine step.
// Member b = blockIdx.z reads its position at positions[b] and its state arrays' addresses from
// ptrs[k * gridDim.z + b], the k-th slot group of its layer in the member table the host fills
// before each replay.
extern "C" __global__ void attention_store_kv_m(const float* __restrict__ kv_in,
                                                const float* __restrict__ w,
                                                const double* __restrict__ freqs,
                                                const int* __restrict__ positions,
                                                const long long* __restrict__ raw_ptrs,
                                                int width, int rope_dim, int cap, float eps) {
    wait_inputs();  // (pdl.py)
    int b = blockIdx.z;
    store_kv(kv_in + (size_t)b * width, w, freqs, positions + b, (float*)raw_ptrs[b], width,
             rope_dim, cap, eps);
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

// Flash-decoding split: block (g, s) takes heads [g * hpb, (g + 1) * hpb) (hpb <= 8) and keys
// [s * 32, (s + 1) * 32), stages those key rows once in shared memory (all heads share the one
// K=V head), and writes per head its partial max m, sum l = sum exp(l_j - m) and
// o = sum exp(l_j - m) k_j into part[(h * splits + s) * (width + 2)] as [m, l, o...].
// Raw keys: min(pos + 1, cap) ring rows; compressed keys: none when ratio == 0, else
// sel[0..sel_count) when sel is given, else rows 0..(pos + 1) / ratio. 256 threads; dynamic
// shared memory: 32 * key_stride(width) key floats (common.cuh), then
// hpb * width query floats, hpb * 32 weights and 32 key row addresses.
__device__ __forceinline__ void partial(const float* __restrict__ q,
                                        const float* __restrict__ raw,
                                        const int* __restrict__ pos, int cap,
                                        const float* __restrict__ comp,
                                        const int* __restrict__ sel,
                                        const int* __restrict__ sel_count, int ratio,
                                        float* part, int width, float scale, int max_keys,
                                        int hpb) {
    extern __shared__ float smem[];
    int stride = key_stride(width);
    float* ks = smem;
    float* qs = ks + SPLIT_KEYS * stride;
    float* ps = qs + hpb * width;
    const float** rows = (const float**)(ps + hpb * SPLIT_KEYS);  // the split's key rows
    int h0 = blockIdx.x * hpb, split = blockIdx.y, splits = gridDim.y;
    int t = pos[0];
    int n_raw = min(t + 1, cap);
    int n_comp = ratio == 0 ? 0 : (sel ? sel_count[0] : (t + 1) / ratio);
    int n = min(n_raw + n_comp, max_keys);
    int first = split * SPLIT_KEYS, count = max(0, min(SPLIT_KEYS, n - first));
    if (threadIdx.x < count)
        rows[threadIdx.x] = key_ptr(key_code(first + threadIdx.x, n_raw, sel), raw, comp, width);
    const float4* q4 = (const float4*)(q + (size_t)h0 * width);
#pragma unroll 4
    for (int i = threadIdx.x; i < hpb * width / 4; i += blockDim.x) ((float4*)qs)[i] = q4[i];
    __syncthreads();
    stage_key_rows(ks, rows, count, width, stride);
    __syncthreads();
    staged_partial(qs, ks, ps, stride, width, count, hpb, scale, part, h0, split, splits);
}

extern "C" __global__ void attention_partial(const float* __restrict__ q,
                                             const float* __restrict__ raw,
                                             const int* __restrict__ pos, int cap,
                                             const float* __restrict__ comp,
                                             const int* __restrict__ sel,
                                             const int* __restrict__ sel_count, int ratio,
                                             float* part, int width, float scale, int max_keys,
                                             int hpb) {
    wait_inputs();  // (pdl.py)
    partial(q, raw, pos, cap, comp, sel, sel_count, ratio, part, width, scale, max_keys, hpb);
}

// attention_partial of member b = blockIdx.z: q [B, heads, width], its raw ring and compressed
// rows from the member table (comp_ptrs null: none), sel [B, sel_stride], part [B, part_stride].
extern "C" __global__ void attention_partial_m(const float* __restrict__ q,
                                               const long long* __restrict__ raw_ptrs,
                                               const int* __restrict__ positions, int cap,
                                               const long long* __restrict__ comp_ptrs,
                                               const int* __restrict__ sel,
                                               const int* __restrict__ sel_count, int sel_stride,
                                               int ratio, float* part, int part_stride,
                                               int width, float scale, int max_keys, int hpb) {
    wait_inputs();  // (pdl.py)
    int b = blockIdx.z, heads = gridDim.x * hpb;
    const float* comp = comp_ptrs ? (const float*)comp_ptrs[b] : nullptr;
    partial(q + (size_t)b * heads * width, (const float*)raw_ptrs[b], positions + b, cap, comp,
            sel ? sel + (size_t)b * sel_stride : nullptr, sel ? sel_count + b : nullptr, ratio,
            part + (size_t)b * part_stride, width, scale, max_keys, hpb);
}

// out[h] = (sum_s exp(m_s - M) o_s) / (exp(sink_h - M) + sum_s exp(m_s - M) l_s), M the largest
// of sink_h and the m_s: softmax over all keys with the sink's mass in the denominator. The
// split weights go through shared memory (2 * splits floats of dynamic shared memory) so the
// value pass issues its loads back to back. freqs non-null: the output then gets the inverse
// RoPE of its trailing rope_dim channels at position positions[blockIdx.z] (rope_tail with sign
// -1, same arithmetic), the pair's other channel taken from the neighbouring lane (width a
// multiple of 32, so whole warps run the channel loop).
extern "C" __global__ void attention_combine(const float* __restrict__ part,
                                             const float* __restrict__ sinks, float* out,
                                             int width, int splits, int part_stride,
                                             const int* __restrict__ positions,
                                             const double* __restrict__ freqs, int rope_dim) {
    wait_inputs();  // (pdl.py)
    __shared__ float red[32];
    extern __shared__ float wsm[];
    int h = blockIdx.x;
    // member blockIdx.z of a batch: part [B, part_stride], out [B, heads, width]
    out += (size_t)blockIdx.z * gridDim.x * width;
    const float* p = part + (size_t)blockIdx.z * part_stride + (size_t)h * splits * (width + 2);
    float m = -INFINITY;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        wsm[s] = p[(size_t)s * (width + 2)];
        wsm[splits + s] = p[(size_t)s * (width + 2) + 1];
        m = fmaxf(m, wsm[s]);
    }
    float M = fmaxf(block_max(m, red), sinks[h]);
    float l = 0.f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        float w = wsm[s] > -INFINITY ? expf(wsm[s] - M) : 0.f;
        l += w * wsm[splits + s];
        wsm[s] = w;
    }
    float inv = 1.f / (block_sum(l, red) + expf(sinks[h] - M));
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float acc = 0.f;
#pragma unroll 8
        for (int s = 0; s < splits; s++) acc += wsm[s] * p[(size_t)s * (width + 2) + 2 + c];
        float v = acc * inv;
        if (freqs) {
            float other = __shfl_xor_sync(0xffffffffu, v, 1);
            int first = width - rope_dim;
            if (c >= first) {
                double ds, dc;
                sincos((double)positions[blockIdx.z] * freqs[(c - first) >> 1], &ds, &dc);
                float sn = (float)ds * -1.f, cs = (float)dc;
                v = ((c - first) & 1) ? other * sn + v * cs : v * cs - other * sn;
            }
        }
        out[(size_t)h * width + c] = v;
    }
}
