// Lightning indexer scores for one query (spec 3.6):
//   score[s] = wscale * sum_h wts[h] * relu(q[h] . keys[s])   for s < (pos + 1) / ratio.
// wscale folds 1/sqrt(heads) and 1/sqrt(hd). Each block scores 32 entries with 256 threads:
// 8 threads per entry, each summing heads h = sub, sub + 8, ...

#define ENTRIES 32

extern "C" __global__ void indexer_scores(const float* __restrict__ q,
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
    for (int i = threadIdx.x; i < heads * hd; i += blockDim.x) qs[(i / hd) * stride + i % hd] = q[i];
    for (int i = threadIdx.x; i < ENTRIES * hd; i += blockDim.x) {
        int e = i / hd;
        ks[e * stride + i % hd] = first + e < n ? keys[(size_t)(first + e) * hd + i % hd] : 0.f;
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
