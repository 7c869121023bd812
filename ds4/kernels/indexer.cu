// Lightning indexer scores for one query (docs/MODEL.md, Indexer):
//   score[s] = wscale * sum_h wts[h] * relu(q[h] . keys[s])   for s < (pos + 1) / ratio.
// wscale folds 1/sqrt(heads) and 1/sqrt(hd). Each block scores 32 entries with 256 threads:
// 8 threads per entry, each summing heads h = sub, sub + 8, ...

#include "common.cuh"

#define ENTRIES 32

__device__ __forceinline__ void scores_of(const float* __restrict__ q,
                                          const float* __restrict__ wts,
                                          const float* __restrict__ keys,
                                          const int* __restrict__ pos, int ratio, float* scores,
                                          int heads, int hd, float wscale) {
    extern __shared__ float smem[];
    int n = (pos[0] + 1) / ratio;
    int first = blockIdx.x * ENTRIES;
    if (first >= n) return;
    // Rows padded by one float so the 8 head-threads of an entry hit different banks.
    int stride = hd + 1;
    float* qs = smem;
    float* ks = smem + heads * stride;
    // 16-byte loads, several in flight per thread before the stores (hd % 4 == 0).
    int h4 = hd >> 2, nq = heads * h4, nk = ENTRIES * h4;
    const float4* q4 = (const float4*)q;
    const float4* k4 = (const float4*)(keys + (size_t)first * hd);
    for (int base = threadIdx.x; base < nq + nk; base += 8 * blockDim.x) {
        float4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int i = base + u * blockDim.x;
            if (i < nq) v[u] = q4[i];
            else if (i < nq + nk) v[u] = first + (i - nq) / h4 < n ? k4[i - nq] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int i = base + u * blockDim.x;
            if (i >= nq + nk) continue;
            float* d = i < nq ? qs + (i / h4) * stride + (i % h4) * 4
                              : ks + ((i - nq) / h4) * stride + ((i - nq) % h4) * 4;
            d[0] = v[u].x; d[1] = v[u].y; d[2] = v[u].z; d[3] = v[u].w;
        }
    }
    __syncthreads();
    int e = threadIdx.x >> 3, sub = threadIdx.x & 7;
    float total = 0.f;
    for (int h = sub; h < heads; h += 8) {
        const float* qh = qs + h * stride;
        const float* k = ks + e * stride;
        float dot = 0.f;
        for (int c = 0; c < hd; c++) dot += qh[c] * k[c];
        total += wts[h] * fmaxf(dot, 0.f);
    }
    for (int o = 4; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (sub == 0 && first + e < n) scores[first + e] = total * wscale;
}

extern "C" __global__ void indexer_scores(const float* __restrict__ q,
                                          const float* __restrict__ wts,
                                          const float* __restrict__ keys,
                                          const int* __restrict__ pos, int ratio, float* scores,
                                          int heads, int hd, float wscale) {
    wait_inputs();  // (pdl.py)
    scores_of(q, wts, keys, pos, ratio, scores, heads, hd, wscale);
}

// Member b = blockIdx.z of a batch graph (see attention.cu): q [B, heads, hd], wts [B, heads],
// its keys' address key_ptrs[b], scores [B, scores_stride].
extern "C" __global__ void indexer_scores_m(const float* __restrict__ q,
                                            const float* __restrict__ wts,
                                            const long long* __restrict__ key_ptrs,
                                            const int* __restrict__ positions, int ratio,
                                            float* scores, int scores_stride, int heads, int hd,
                                            float wscale) {
    wait_inputs();  // (pdl.py)
    int b = blockIdx.z;
    scores_of(q + (size_t)b * heads * hd, wts + (size_t)b * heads, (const float*)key_ptrs[b],
              positions + b, ratio, scores + (size_t)b * scores_stride, heads, hd, wscale);
}
