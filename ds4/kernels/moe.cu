// Mixture of experts for decode (spec 3.8): router top-k on sqrt(softplus(logit)) and the expert
// GEMVs with clamped SwiGLU. Expert weights are bf16 words: gate/up rows [inter, cols] each and
// down [rows, inter], expert e at base + e * expert_stride (HF stacked layout).

#ifndef INFINITY  // NVRTC has no math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float dot8(uint4 w, const float4* x) {
    float4 a = x[0], b = x[1];
    return bf16_lo(w.x) * a.x + bf16_hi(w.x) * a.y + bf16_lo(w.y) * a.z + bf16_hi(w.y) * a.w
         + bf16_lo(w.z) * b.x + bf16_hi(w.z) * b.y + bf16_lo(w.w) * b.z + bf16_hi(w.w) * b.w;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Router: s = sqrt(softplus(logit)); choose top_k by s + bias (bias may be null), or take
// tid2eid[token] (hash layers, when tid2eid is given); weights w = s[idx] / sum * route_scale.
// One block of >= n_experts threads (a multiple of 32, at most 1024).
extern "C" __global__ void moe_route(const float* __restrict__ logits,
                                     const float* __restrict__ bias,
                                     const int* __restrict__ tid2eid,
                                     const int* __restrict__ token, int n_experts, int top_k,
                                     float route_scale, int* idx, float* wts) {
    __shared__ float score[1024], choice[1024];
    __shared__ float bv[32];
    __shared__ int bi[32], picked[32];
    int e = threadIdx.x, lane = e & 31, warp = e >> 5, nw = blockDim.x >> 5;
    if (e < n_experts) {
        float l = logits[e];
        float sp = l > 20.f ? l : log1pf(expf(l));
        score[e] = sqrtf(sp);
        choice[e] = score[e] + (bias ? bias[e] : 0.f);
    } else {
        choice[e] = -INFINITY;
    }
    __syncthreads();
    for (int r = 0; r < top_k; r++) {
        if (tid2eid) {
            if (e == 0) picked[r] = tid2eid[(size_t)token[0] * top_k + r];
            continue;
        }
        float v = choice[e];
        int i = e;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            int oi = __shfl_xor_sync(0xffffffffu, i, o);
            if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
        }
        if (lane == 0) { bv[warp] = v; bi[warp] = i; }
        __syncthreads();
        if (e == 0) {
            v = bv[0]; i = bi[0];
            for (int w = 1; w < nw; w++)
                if (bv[w] > v || (bv[w] == v && bi[w] < i)) { v = bv[w]; i = bi[w]; }
            picked[r] = i;
            choice[i] = -INFINITY;
        }
        __syncthreads();
    }
    __syncthreads();
    if (e == 0) {
        float total = 0.f;
        for (int r = 0; r < top_k; r++) total += score[picked[r]];
        for (int r = 0; r < top_k; r++) {
            idx[r] = picked[r];
            wts[r] = score[picked[r]] / total * route_scale;
        }
    }
}

// act[k, j] = silu(min(gate_j . x, limit)) * clamp(up_j . x, -limit, limit) * wts[k] for the
// expert idx[k] (k = blockIdx.y); idx null means expert k, wts null means weight 1 (the shared
// expert). One warp per row j. Requires cols % 8 == 0.
extern "C" __global__ void moe_gate_up(const unsigned short* __restrict__ gate_base,
                                       const unsigned short* __restrict__ up_base,
                                       long long expert_stride, const int* __restrict__ idx,
                                       const float* __restrict__ wts,
                                       const float* __restrict__ x, float* act, int inter,
                                       int cols, float limit) {
    int j = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31, k = blockIdx.y;
    if (j >= inter) return;
    long long e = idx ? idx[k] : k;
    const uint4* g = (const uint4*)(gate_base + e * expert_stride + (size_t)j * cols);
    const uint4* u = (const uint4*)(up_base + e * expert_stride + (size_t)j * cols);
    const float4* xv = (const float4*)x;
    float ga = 0.f, gb = 0.f, ua = 0.f, ub = 0.f;
    int n8 = cols >> 3, i = lane;
    for (; i + 32 < n8; i += 64) {
        uint4 g0 = __ldcs(g + i), g1 = __ldcs(g + i + 32), u0 = __ldcs(u + i), u1 = __ldcs(u + i + 32);
        ga += dot8(g0, xv + 2 * i);
        gb += dot8(g1, xv + 2 * (i + 32));
        ua += dot8(u0, xv + 2 * i);
        ub += dot8(u1, xv + 2 * (i + 32));
    }
    for (; i < n8; i += 32) {
        ga += dot8(__ldcs(g + i), xv + 2 * i);
        ua += dot8(__ldcs(u + i), xv + 2 * i);
    }
    float gs = warp_sum(ga + gb), us = warp_sum(ua + ub);
    if (lane == 0) {
        gs = fminf(gs, limit);
        us = fminf(fmaxf(us, -limit), limit);
        act[(size_t)k * inter + j] = gs / (1.f + expf(-gs)) * us * (wts ? wts[k] : 1.f);
    }
}

// y[r] (+)= sum_k down[idx[k]][r, :] . act[k]; one warp per output row, all n_sel experts, so no
// atomics. idx null means expert k. accumulate != 0 adds to y (the shared expert's output).
extern "C" __global__ void moe_down(const unsigned short* __restrict__ down_base,
                                    long long expert_stride, const int* __restrict__ idx,
                                    const float* __restrict__ act, float* y, int rows, int inter,
                                    int n_sel, int accumulate) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    int n8 = inter >> 3;
    float acc = 0.f;
    for (int k = 0; k < n_sel; k++) {
        long long e = idx ? idx[k] : k;
        const uint4* w = (const uint4*)(down_base + e * expert_stride + (size_t)r * inter);
        const float4* a = (const float4*)(act + (size_t)k * inter);
        int i = lane;
        for (; i + 32 < n8; i += 64) {
            uint4 w0 = __ldcs(w + i), w1 = __ldcs(w + i + 32);
            acc += dot8(w0, a + 2 * i) + dot8(w1, a + 2 * (i + 32));
        }
        for (; i < n8; i += 32) acc += dot8(__ldcs(w + i), a + 2 * i);
    }
    acc = warp_sum(acc);
    if (lane == 0) y[r] = accumulate ? y[r] + acc : acc;
}
