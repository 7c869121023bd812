// Lightning indexer scores for one query (docs/MODEL.md, Indexer):
//   score[s] = wscale * sum_h wts[h] * relu(q[h] . keys[s])   for s < (pos + 1) / ratio.
// wscale folds 1/sqrt(heads) and 1/sqrt(hd). Each block scores 32 entries with 256 threads:
// 8 threads per entry, each summing heads h = sub, sub + 8, ... Each thread runs its heads' dot
// products side by side, a float4 of the key and of each head's query from shared memory per 4
// channels (one key load serves all its heads): reading both operands from shared memory for
// every product bounded the kernel by shared-memory loads. Every dot product still adds its
// channels in order, so the scores are the same bits as one product at a time.

#include "common.cuh"

#define ENTRIES 32
#define HEADS_AT_ONCE 8  // a thread's dot products in flight (64 heads: all of its 8)

// dot[j] += q[8 j] . k over h4 float4s for the m heads q, q + 8 stride, ... (m <= HPB when
// HPB > 1; HPB == 1: any m, one head at a time). A whole round (HPB == m) unrolls with no
// branch between the heads, so their shared-memory reads issue together (a runtime count
// put each read behind a branch and the one before it).
template <int HPB>
__device__ __forceinline__ void head_dots(const float4* k, const float* q, int stride, int h4,
                                          int m, float* dot) {
    for (int c = 0; c < h4; c++) {
        float4 kv = k[c];
#pragma unroll
        for (int j = 0; j < (HPB > 1 ? HPB : HEADS_AT_ONCE); j++) {
            if (HPB == 1 && j >= m) break;
            float4 qv = ((const float4*)(q + 8 * j * stride))[c];
            dot[j] += qv.x * kv.x;
            dot[j] += qv.y * kv.y;
            dot[j] += qv.z * kv.z;
            dot[j] += qv.w * kv.w;
        }
    }
}

__device__ __forceinline__ void scores_of(const float* __restrict__ q,
                                          const float* __restrict__ wts,
                                          const float* __restrict__ keys,
                                          const int* __restrict__ pos, int ratio, float* scores,
                                          int heads, int hd, float wscale) {
    extern __shared__ float smem[];
    int n = (pos[0] + 1) / ratio;
    int first = blockIdx.x * ENTRIES;
    if (first >= n) return;
    // Rows padded by four floats: float4 rows, and the 8 head-threads of an entry (and the 4
    // entries of a warp) on different banks.
    int stride = hd + 4;
    float* qs = smem;
    float* ks = smem + heads * stride;
    // the heads' query rows, then the block's key rows (zeros past the last entry): one block
    // of heads + ENTRIES rows (hd % 4 == 0)
    int h4 = hd >> 2;
    const float4* q4 = (const float4*)q;
    const float4* k4 = (const float4*)(keys + (size_t)first * hd);
    stage_rows(smem, heads + ENTRIES, hd, stride, [&](int r) -> const float4* {
        if (r < heads) return q4 + r * h4;
        return first + r - heads < n ? k4 + (r - heads) * h4 : nullptr;
    });
    __syncthreads();
    int e = threadIdx.x >> 3, sub = threadIdx.x & 7;
    float total = 0.f;
    const float4* k = (const float4*)(ks + e * stride);
    for (int h0 = sub; h0 < heads; h0 += 8 * HEADS_AT_ONCE) {
        float dot[HEADS_AT_ONCE] = {};
        int m = min(HEADS_AT_ONCE, (heads - h0 + 7) / 8);  // this thread's heads of the round
        if (m == HEADS_AT_ONCE)
            head_dots<HEADS_AT_ONCE>(k, qs + h0 * stride, stride, h4, m, dot);
        else
            head_dots<1>(k, qs + h0 * stride, stride, h4, m, dot);
#pragma unroll
        for (int j = 0; j < HEADS_AT_ONCE; j++)
            if (j < m) total += wts[h0 + 8 * j] * fmaxf(dot[j], 0.f);
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

// Prefill's head sum over a chunk's products (ds4/model/indexer.py, index_scores): out[t, s] =
// sum_h w[t, h] * (relu(dots[t, h, s]) * scale), heads in order, for dots [rows, heads, count]
// from one GEMM. One pass over the products instead of three (relu, scale, then a batched
// GEMV), each a full read and most a full write of the [rows, heads, count] block.
extern "C" __global__ void indexer_head_sum(const float* __restrict__ dots,
                                            const float* __restrict__ w, float scale, int heads,
                                            int count, float* __restrict__ out) {
    wait_inputs();  // (pdl.py)
    extern __shared__ float wt[];  // this row's head weights
    int t = blockIdx.y;
    for (int h = threadIdx.x; h < heads; h += blockDim.x) wt[h] = w[(size_t)t * heads + h];
    __syncthreads();
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= count) return;
    const float* d = dots + (size_t)t * heads * count + s;
    float total = 0.f;
    for (int h = 0; h < heads; h++)
        total = __fmaf_rn(wt[h], __fmul_rn(fmaxf(d[(size_t)h * count], 0.f), scale), total);
    out[(size_t)t * count + s] = total;
}
