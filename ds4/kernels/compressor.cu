// KV compressors for decode (docs/MODEL.md, Compressors), on the state layout of model/state.py:
// pending_kv/pending_score [m, cw] hold the open window's rows at slot pos % m (scores with the
// position bias added), cw = c * hd (c = 2 for CSA and the indexer, 1 for HCA); with overlap,
// overlap_kv/overlap_score [m, hd] hold the A-half of the last closed window (scores -inf before
// the first window closes).

#include "common.cuh"

// Store token pos's projected row kvp and score g + bias[pos % m] at slot pos % m.
__device__ __forceinline__ void push(const float* __restrict__ kvp, const float* __restrict__ g,
                                     const float* __restrict__ bias, const int* __restrict__ pos,
                                     float* pending_kv, float* pending_score, int m, int cw) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cw) return;
    size_t row = (size_t)(pos[0] % m) * cw;
    pending_kv[row + c] = kvp[c];
    pending_score[row + c] = g[c] + bias[row + c];
}

extern "C" __global__ void compressor_push(const float* __restrict__ kvp,
                                           const float* __restrict__ g,
                                           const float* __restrict__ bias,
                                           const int* __restrict__ pos, float* pending_kv,
                                           float* pending_score, int m, int cw) {
    wait_inputs();  // (pdl.py)
    push(kvp, g, bias, pos, pending_kv, pending_score, m, cw);
}

// When token pos closes window w = (pos + 1) / m - 1: pool each channel by a softmax over the
// window's slots (with overlap: the last window's A-half, then this window's B-half), RMSNorm_w
// the pooled row, rope its trailing rope_dim channels at position m*w, store it as comp[w]; with
// overlap, this window's A-half becomes the overlap. One block of >= hd threads (hd <= 1024);
// returns at once when no window closes.
__device__ __forceinline__ void pool(const float* __restrict__ pending_kv,
                                     const float* __restrict__ pending_score,
                                     float* overlap_kv, float* overlap_score,
                                     const float* __restrict__ norm_w,
                                     const double* __restrict__ freqs,
                                     const int* __restrict__ pos, float* comp, int m, int hd,
                                     int rope_dim, float eps) {
    __shared__ float red[32];
    extern __shared__ float row[];
    int t = pos[0];
    if ((t + 1) % m != 0) return;
    int w = (t + 1) / m - 1;
    int c = threadIdx.x;
    int overlap = overlap_kv != 0;
    int cw = overlap ? 2 * hd : hd;
    int col = overlap ? hd + c : c;
    float pooled = 0.f;
    if (c < hd) {
        float mx = -INFINITY;
        if (overlap)
            for (int i = 0; i < m; i++) mx = fmaxf(mx, overlap_score[(size_t)i * hd + c]);
        for (int i = 0; i < m; i++) mx = fmaxf(mx, pending_score[(size_t)i * cw + col]);
        float s = 0.f, acc = 0.f;
        if (overlap) {
            for (int i = 0; i < m; i++) {
                float e = expf(overlap_score[(size_t)i * hd + c] - mx);
                s += e;
                acc += e * overlap_kv[(size_t)i * hd + c];
            }
        }
        for (int i = 0; i < m; i++) {
            float e = expf(pending_score[(size_t)i * cw + col] - mx);
            s += e;
            acc += e * pending_kv[(size_t)i * cw + col];
        }
        pooled = acc / s;
        if (overlap) {  // this thread alone reads and writes column c of the overlap
            for (int i = 0; i < m; i++) {
                overlap_kv[(size_t)i * hd + c] = pending_kv[(size_t)i * cw + c];
                overlap_score[(size_t)i * hd + c] = pending_score[(size_t)i * cw + c];
            }
        }
    }
    float r = rsqrtf(block_sum(pooled * pooled, red) / hd + eps);
    if (c < hd) row[c] = pooled * r * norm_w[c];
    __syncthreads();
    if (c < hd)
        comp[(size_t)w * hd + c] = rope_channel(row, c, hd - rope_dim, (double)m * w, freqs);
}

extern "C" __global__ void compressor_pool(const float* __restrict__ pending_kv,
                                           const float* __restrict__ pending_score,
                                           float* overlap_kv, float* overlap_score,
                                           const float* __restrict__ norm_w,
                                           const double* __restrict__ freqs,
                                           const int* __restrict__ pos, float* comp, int m,
                                           int hd, int rope_dim, float eps) {
    wait_inputs();  // (pdl.py)
    pool(pending_kv, pending_score, overlap_kv, overlap_score, norm_w, freqs, pos, comp, m, hd,
         rope_dim, eps);
}

// One compressor step of member b = blockIdx.z of a batch graph (see attention.cu): push its
// projected row (kvp, g [B, row_stride]) at slot pos % m, then pool the window if this token
// closes it, in one launch. ptrs holds the member table's slot groups [pending_kv,
// pending_score, overlap_kv, overlap_score, comp] (a null overlap: none). One block of >= hd
// threads; thread c pushes columns c and c + hd (cw = 2 hd), the only ones it pools, so no
// other thread's write is read.
extern "C" __global__ void compressor_step_m(const float* __restrict__ kvp,
                                             const float* __restrict__ g, int row_stride,
                                             const float* __restrict__ bias,
                                             const int* __restrict__ positions,
                                             const long long* __restrict__ ptrs,
                                             const float* __restrict__ norm_w,
                                             const double* __restrict__ freqs, int m, int cw,
                                             int hd, int rope_dim, float eps) {
    wait_inputs();  // (pdl.py)
    int b = blockIdx.z, B = gridDim.z, c = threadIdx.x;
    const int* pos = positions + b;
    float* pending_kv = (float*)ptrs[b];
    float* pending_score = (float*)ptrs[B + b];
    if (c < hd) {
        size_t row = (size_t)(pos[0] % m) * cw;
        for (int j = c; j < cw; j += hd) {
            pending_kv[row + j] = kvp[(size_t)b * row_stride + j];
            pending_score[row + j] = g[(size_t)b * row_stride + j] + bias[row + j];
        }
    }
    pool(pending_kv, pending_score, (float*)ptrs[2 * B + b], (float*)ptrs[3 * B + b], norm_w,
         freqs, pos, (float*)ptrs[4 * B + b], m, hd, rope_dim, eps);
}

// Prefill: the nw windows a chunk closes, pooled at once. win_kv / win_score [nw, m, cw] (scores
// with the position bias added); overlap_kv / overlap_score [m, hd]: the A-half carried from
// before window 0 (null: no overlap, cw = hd). pooled[w, c] = the softmax pool of channel c over
// the slots of pool() above: window w - 1's A-half (the carried one for w = 0), then window w's
// B-half; without overlap, window w's rows. Norm, rope and the state update stay with the model
// code. Grid (ceil(hd / blockDim), nw), one thread a channel.
extern "C" __global__ void compressor_pool_windows(const float* __restrict__ win_kv,
                                                   const float* __restrict__ win_score,
                                                   const float* __restrict__ overlap_kv,
                                                   const float* __restrict__ overlap_score,
                                                   float* __restrict__ pooled, int m, int hd) {
    wait_inputs();  // (pdl.py)
    int w = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= hd) return;
    int overlap = overlap_kv != 0, cw = overlap ? 2 * hd : hd;
    const float* kv = win_kv + (size_t)w * m * cw + (overlap ? hd + c : c);
    const float* sc = win_score + (size_t)w * m * cw + (overlap ? hd + c : c);
    const float* pkv = w ? win_kv + (size_t)(w - 1) * m * cw + c : overlap_kv + c;
    const float* psc = w ? win_score + (size_t)(w - 1) * m * cw + c : overlap_score + c;
    size_t pstride = w ? cw : hd;
    float mx = -INFINITY;
    if (overlap)
        for (int i = 0; i < m; i++) mx = fmaxf(mx, psc[i * pstride]);
    for (int i = 0; i < m; i++) mx = fmaxf(mx, sc[(size_t)i * cw]);
    float s = 0.f, acc = 0.f;
    if (overlap) {
        for (int i = 0; i < m; i++) {
            float e = expf(psc[i * pstride] - mx);
            s += e;
            acc += e * pkv[i * pstride];
        }
    }
    for (int i = 0; i < m; i++) {
        float e = expf(sc[(size_t)i * cw] - mx);
        s += e;
        acc += e * kv[(size_t)i * cw];
    }
    pooled[(size_t)w * hd + c] = acc / s;
}
