// The mHC hyper-connections' shared pieces (hyper_connection.cu's kernels, hc_unit.cu's
// decode unit): the mix's weights pre, post and comb (with the Sinkhorn) and the expansion of one
// channel into the next streams. X is the residual state [streams, D], all fp32.
#pragma once

#include "common.cuh"

#define MAX_STREAMS 8

__device__ __forceinline__ float sigmoidf(float v) { return 1.f / (1.f + expf(-v)); }

constexpr int MAX_D = 8192;  // channels a block keeps in shared memory

// pre, post and the Sinkhorn-normalised comb matrix from mix (n = streams). comb[i*n + j].
__device__ void hc_weights(const float* mix, const float* scale, const float* base, int n,
                           int iters, float eps, float* pre, float* post, float* comb) {
    for (int i = 0; i < n; i++) {
        pre[i] = sigmoidf(mix[i] * scale[0] + base[i]) + eps;
        post[i] = 2.f * sigmoidf(mix[n + i] * scale[1] + base[n + i]);
    }
    for (int i = 0; i < n; i++) {
        float m = -INFINITY, s = 0.f;
        for (int j = 0; j < n; j++) {
            comb[i * n + j] = mix[2 * n + i * n + j] * scale[2] + base[2 * n + i * n + j];
            m = fmaxf(m, comb[i * n + j]);
        }
        for (int j = 0; j < n; j++) s += (comb[i * n + j] = expf(comb[i * n + j] - m));
        for (int j = 0; j < n; j++) comb[i * n + j] = comb[i * n + j] / s + eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) {  // rows, then columns; the first pass normalises columns only
            for (int i = 0; i < n; i++) {
                float s = 0.f;
                for (int j = 0; j < n; j++) s += comb[i * n + j];
                for (int j = 0; j < n; j++) comb[i * n + j] /= (s + eps);
            }
        }
        for (int j = 0; j < n; j++) {
            float s = 0.f;
            for (int i = 0; i < n; i++) s += comb[i * n + j];
            for (int i = 0; i < n; i++) comb[i * n + j] /= (s + eps);
        }
    }
}

// Whether one warp computes a unit's weights (hc_weights_warp): n a power of two, n * n <= 32.
__device__ __forceinline__ bool warp_weights(int n) { return (n & (n - 1)) == 0 && n * n <= 32; }

// The same weights computed by one warp, lane i*n + j holding comb[i][j] (warp_weights(n)):
// row sums reduce over lane bits below n, column sums over the bits above. A serial Sinkhorn
// costs ~20 us of divisions in one thread; this costs ~1 us.
__device__ void hc_weights_warp(const float* mix, const float* scale, const float* base, int n,
                                int iters, float eps, float* pre, float* post, float* comb) {
    int lane = threadIdx.x & 31, nn = n * n;
    if (lane < n) {
        pre[lane] = sigmoidf(mix[lane] * scale[0] + base[lane]) + eps;
        post[lane] = 2.f * sigmoidf(mix[n + lane] * scale[1] + base[n + lane]);
    }
    float v = lane < nn ? mix[2 * n + lane] * scale[2] + base[2 * n + lane] : 0.f;
    float m = v;
    for (int o = 1; o < n; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float e = expf(v - m), s = e;
    for (int o = 1; o < n; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    float c = e / s + eps;
    for (int it = 0; it < iters; it++) {
        if (it > 0) {  // rows, then columns; the first pass normalises columns only
            float r = c;
            for (int o = 1; o < n; o <<= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
            c = c / (r + eps);
        }
        float col = c;
        for (int o = n; o < nn; o <<= 1) col += __shfl_xor_sync(0xffffffffu, col, o);
        c = c / (col + eps);
    }
    if (lane < nn) comb[lane] = c;
}

// X_new[j] = post[j] * y + sum_i comb[i, j] X[i] (the C^T direction) at channel d of one
// token's streams X [n, D], into xn[j] (registers): all of X[:, d] is read first.
__device__ __forceinline__ void expand_channel(const float* X, const float* y, const float* post,
                                               const float* comb, int D, int n, int d,
                                               float* xn) {
    float xs[MAX_STREAMS];
    // Constant trip counts keep xs in registers.
#pragma unroll
    for (int i = 0; i < MAX_STREAMS; i++) xs[i] = i < n ? X[(size_t)i * D + d] : 0.f;
    float yd = y[d];
#pragma unroll
    for (int j = 0; j < MAX_STREAMS; j++) {
        if (j >= n) break;
        float acc = post[j] * yd;
#pragma unroll
        for (int i = 0; i < MAX_STREAMS; i++)
            if (i < n) acc += comb[i * n + j] * xs[i];
        xn[j] = acc;
    }
}
