// KV compressors for decode (spec 3.5, 4.1), in the ds4 state layout: state_kv/state_score are
// [rows, cw] with cw = c * hd (c = 2 with overlap for CSA and the indexer, 1 for HCA). With
// overlap, rows [0, m) hold the last closed window and rows [m, 2m) the open one; without it,
// rows [0, m) hold the open window. Unfilled scores are -inf.

#ifndef INFINITY  // NVRTC has no math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

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

// Store token pos's projected row kvp and score g + bias[pos % m] into the open window.
extern "C" __global__ void compressor_push(const float* __restrict__ kvp,
                                           const float* __restrict__ g,
                                           const float* __restrict__ bias,
                                           const int* __restrict__ pos, float* state_kv,
                                           float* state_score, int m, int cw, int overlap) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cw) return;
    int slot = pos[0] % m;
    size_t row = (size_t)(overlap ? m + slot : slot) * cw;
    state_kv[row + c] = kvp[c];
    state_score[row + c] = g[c] + bias[(size_t)slot * cw + c];
}

// When token pos closes window w = (pos + 1) / m - 1: pool each channel by a softmax over the
// window's slots, RMSNorm_w the pooled row, rope its trailing rope_dim channels at position m*w,
// store it as comp[w]; with overlap, the open window then becomes the closed one. One block of
// hd threads (hd <= 1024); returns at once when no window closes.
extern "C" __global__ void compressor_pool(float* state_kv, float* state_score,
                                           const float* __restrict__ norm_w,
                                           const float* __restrict__ freqs,
                                           const int* __restrict__ pos, float* comp, int m,
                                           int hd, int overlap, int rope_dim, float eps) {
    __shared__ float red[32];
    extern __shared__ float row[];
    int t = pos[0];
    if ((t + 1) % m != 0) return;
    int w = (t + 1) / m - 1;
    int c = threadIdx.x;
    int cw = overlap ? 2 * hd : hd;
    float pooled = 0.f;
    if (c < hd) {
        int slots = overlap ? 2 * m : m;
        float mx = -INFINITY;
        for (int i = 0; i < slots; i++) {
            int col = (overlap && i >= m) ? hd + c : c;
            mx = fmaxf(mx, state_score[(size_t)i * cw + col]);
        }
        float s = 0.f, acc = 0.f;
        for (int i = 0; i < slots; i++) {
            int col = (overlap && i >= m) ? hd + c : c;
            float e = expf(state_score[(size_t)i * cw + col] - mx);
            s += e;
            acc += e * state_kv[(size_t)i * cw + col];
        }
        pooled = acc / s;
        if (overlap) {
            for (int i = 0; i < m; i++) {
                size_t src = (size_t)(m + i) * cw, dst = (size_t)i * cw;
                state_kv[dst + c] = state_kv[src + c];
                state_kv[dst + hd + c] = state_kv[src + hd + c];
                state_score[dst + c] = state_score[src + c];
                state_score[dst + hd + c] = state_score[src + hd + c];
            }
        }
    }
    float r = rsqrtf(block_sum(pooled * pooled, red) / hd + eps);
    if (c < hd) row[c] = pooled * r * norm_w[c];
    __syncthreads();
    if (c >= hd) return;
    float out = row[c];
    int first = hd - rope_dim;
    if (c >= first) {
        int k = (c - first) >> 1;
        float s, co;
        sincosf((float)(m * w) * freqs[k], &s, &co);
        float a = row[first + 2 * k], b = row[first + 2 * k + 1];
        out = ((c - first) & 1) ? a * s + b * co : a * co - b * s;
    }
    comp[(size_t)w * hd + c] = out;
}
