// Mixture of experts for decode (docs/MODEL.md, Mixture of experts): router top-k on
// sqrt(softplus(logit)) and the expert GEMVs with clamped SwiGLU. Expert weights are bf16 words
// or fp32: gate/up rows [inter, cols] each and down [rows, inter], expert e at
// base + e * expert_stride (HF stacked layout).

#include "common.cuh"

// The router's pick of one token's experts: s = sqrt(softplus(logit)); the top_k experts by
// s + bias (bias may be null), or tid2eid[token] (hash layers, when tid2eid is given); weights
// w = s[idx] / sum * route_scale. One warp per token, lane l holding experts l, l + 32, ..
// (n_experts <= 32 * SLOTS, top_k <= 32): a pick is one warp argmax, no block barrier (a
// block of n_experts threads spent most of its time meeting at two barriers a pick). SLOTS
// is the fewest that hold the experts (8 for V4's 256): each pick scans a lane's slots twice
// (32 slots for 256 experts: 16.5 against 11.3 us a launch under Nsight, docs/PERF.md).

// The lane's value of slot j (a register array indexed by a run-time j, kept in registers).
template <int SLOTS>
__device__ __forceinline__ float slot_of(const float (&v)[SLOTS], int j) {
    float out = 0.f;
#pragma unroll
    for (int s = 0; s < SLOTS; s++)
        if (s == j) out = v[s];
    return out;
}

// idx[r], wts[r] for r < top_k of the token whose router logits these are, by the calling
// warp.
template <int SLOTS>
__device__ __forceinline__ void route_member(const float* logits, const float* bias,
                                             const int* tid2eid, const int* token,
                                             int n_experts, int top_k, float route_scale,
                                             int* idx, float* wts) {
    int lane = threadIdx.x & 31;
    // a hash layer's picks, lane r's the r-th: one load each, all in flight with the logits'
    int hashed = tid2eid && lane < top_k ? tid2eid[(size_t)token[0] * top_k + lane] : 0;
    float score[SLOTS], choice[SLOTS];
#pragma unroll
    for (int j = 0; j < SLOTS; j++) {
        int e = lane + 32 * j;
        score[j] = 0.f;
        choice[j] = -INFINITY;
        if (e < n_experts) {
            float l = logits[e];
            float sp = l > 20.f ? l : log1pf(expf(l));
            score[j] = sqrtf(sp);
            choice[j] = score[j] + (bias ? bias[e] : 0.f);
        }
    }
    int mine = 0;
    float mine_s = 0.f, total = 0.f;
    for (int r = 0; r < top_k; r++) {
        int e;
        if (tid2eid) {
            e = __shfl_sync(0xffffffffu, hashed, r);
        } else {  // the largest choice, ties to the lower expert
            float v = choice[0];
            e = lane;
#pragma unroll
            for (int j = 1; j < SLOTS; j++)
                if (choice[j] > v) { v = choice[j]; e = lane + 32 * j; }
            warp_argmax(v, e);
#pragma unroll
            for (int j = 0; j < SLOTS; j++)
                if (lane + 32 * j == e) choice[j] = -INFINITY;
        }
        float s = __shfl_sync(0xffffffffu, slot_of<SLOTS>(score, e >> 5), e & 31);
        total += s;  // in pick order
        if (lane == r) { mine = e; mine_s = s; }
    }
    if (lane < top_k) {
        idx[lane] = mine;
        wts[lane] = mine_s / (total + 1e-20f) * route_scale;
    }
}

// Router (route_member): one warp per member (blockIdx.z); logits [B, logits_ld], token [B],
// idx/wts [B, out_ld]. _8: up to 256 experts, _32: up to 1024.
#define MOE_ROUTE(SLOTS) \
    extern "C" __global__ void moe_route_##SLOTS( \
        const float* __restrict__ logits, const float* __restrict__ bias, \
        const int* __restrict__ tid2eid, const int* __restrict__ token, int n_experts, \
        int top_k, float route_scale, int* idx, float* wts, int logits_ld, int out_ld) { \
        wait_inputs(); \
        size_t z = blockIdx.z; \
        route_member<SLOTS>(logits + z * logits_ld, bias, tid2eid, token + z, n_experts, top_k, \
                            route_scale, idx + z * out_ld, wts + z * out_ld); \
    }
MOE_ROUTE(8)
MOE_ROUTE(32)

// act[k, j] = silu(min(gate_j . x, limit)) * clamp(up_j . x, -limit, limit) * wts[k] for the
// expert idx[k] (k = blockIdx.y); idx null means expert k, wts null means weight 1 (the shared
// expert). One warp per row j. Requires cols % 8 == 0. limit <= 0 turns the clamps off.
template <typename W>
__device__ void gate_up(const W* gate_base, const W* up_base, long long expert_stride,
                        const int* idx, const float* wts, const float* x, float* act, int inter,
                        int cols, float limit, const W* shared_gate, const W* shared_up) {
    int j = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31, k = blockIdx.y;
    if (j >= inter) return;
    // With a shared expert, the last grid row computes it (weight 1) in the same launch.
    bool shared = shared_gate != 0 && k == (int)gridDim.y - 1;
    long long e = shared ? 0 : (idx ? idx[k] : k);
    float wk = shared ? 1.f : (wts ? wts[k] : 1.f);
    const W* g = (shared ? shared_gate : gate_base + e * expert_stride) + (size_t)j * cols;
    const W* u = (shared ? shared_up : up_base + e * expert_stride) + (size_t)j * cols;
    const float4* xv = (const float4*)x;
    float ga = 0.f, gb = 0.f, ua = 0.f, ub = 0.f;
    int n8 = cols >> 3, i = lane;
    for (; i + 96 < n8; i += 128) {  // eight 16-byte loads in flight per lane
        Pack<W> g0, g1, g2, g3, u0, u1, u2, u3;
        g0.load(g, i); g1.load(g, i + 32); g2.load(g, i + 64); g3.load(g, i + 96);
        u0.load(u, i); u1.load(u, i + 32); u2.load(u, i + 64); u3.load(u, i + 96);
        ga += g0.dot(xv + 2 * i) + g2.dot(xv + 2 * (i + 64));
        gb += g1.dot(xv + 2 * (i + 32)) + g3.dot(xv + 2 * (i + 96));
        ua += u0.dot(xv + 2 * i) + u2.dot(xv + 2 * (i + 64));
        ub += u1.dot(xv + 2 * (i + 32)) + u3.dot(xv + 2 * (i + 96));
    }
    for (; i < n8; i += 32) {
        ga += pack_dot(g, xv, i);
        ua += pack_dot(u, xv, i);
    }
    float gs = warp_sum(ga + gb), us = warp_sum(ua + ub);
    if (lane == 0) {
        if (limit > 0.f) {
            gs = fminf(gs, limit);
            us = fminf(fmaxf(us, -limit), limit);
        }
        act[(size_t)k * inter + j] = gs / (1.f + expf(-gs)) * us * wk;
    }
}

// y[r] (+)= sum_k down[idx[k]][r, :] . act[k]; one warp per output row, all n_sel experts, so no
// atomics. idx null means expert k. accumulate != 0 adds to y (the shared expert's output).
template <typename W>
__device__ void down(const W* down_base, long long expert_stride, const int* idx,
                     const float* act, float* y, int rows, int inter, int n_sel, int accumulate,
                     const W* shared_down) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    int n8 = inter >> 3;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    int total = n_sel + (shared_down != 0);  // act row n_sel belongs to the shared expert
    for (int k = 0; k < total; k++) {
        const W* w = (k == n_sel ? shared_down : down_base + (idx ? idx[k] : k) * expert_stride)
                     + (size_t)r * inter;
        row_dot_partial(w, (const float4*)(act + (size_t)k * inter), n8, acc);
    }
    float sum = warp_sum4(acc);
    if (lane == 0) y[r] = accumulate ? y[r] + sum : sum;
}

#define GATE_UP_ARGS(W) const W* __restrict__ gate_base, const W* __restrict__ up_base, \
    long long expert_stride, const int* __restrict__ idx, const float* __restrict__ wts,  \
    const float* __restrict__ x, float* act, int inter, int cols, float limit,             \
    const W* __restrict__ shared_gate, const W* __restrict__ shared_up
#define DOWN_ARGS(W) const W* __restrict__ down_base, long long expert_stride, \
    const int* __restrict__ idx, const float* __restrict__ act, float* y, int rows, int inter, \
    int n_sel, int accumulate, const W* __restrict__ shared_down

extern "C" __global__ void moe_gate_up_bf16(GATE_UP_ARGS(unsigned short)) {
    wait_inputs();  // (pdl.py)
    gate_up(gate_base, up_base, expert_stride, idx, wts, x, act, inter, cols, limit, shared_gate,
            shared_up);
}
extern "C" __global__ void moe_gate_up_f32(GATE_UP_ARGS(float)) {
    wait_inputs();  // (pdl.py)
    gate_up(gate_base, up_base, expert_stride, idx, wts, x, act, inter, cols, limit, shared_gate,
            shared_up);
}
extern "C" __global__ void moe_down_bf16(DOWN_ARGS(unsigned short)) {
    wait_inputs();  // (pdl.py)
    down(down_base, expert_stride, idx, act, y, rows, inter, n_sel, accumulate, shared_down);
}
extern "C" __global__ void moe_down_f32(DOWN_ARGS(float)) {
    wait_inputs();  // (pdl.py)
    down(down_base, expert_stride, idx, act, y, rows, inter, n_sel, accumulate, shared_down);
}

// Prefill: act[r, j] = silu(min(g, limit)) * clamp(u, -limit, limit) * scale[r] for the rows of a
// GEMM's output y [rows, 2 * inter] (gate products, then up); scale null means 1.
extern "C" __global__ void swiglu_rows(const float* __restrict__ y, const float* __restrict__ scale,
                                       float* __restrict__ act, int rows, int inter, float limit) {
    wait_inputs();  // (pdl.py)
    long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (t >= (long long)rows * inter) return;
    long long r = t / inter;
    int j = (int)(t - r * inter);
    float g = y[r * 2 * inter + j], u = y[r * 2 * inter + inter + j];
    if (limit > 0.f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    act[t] = g / (1.f + expf(-g)) * u * (scale ? scale[r] : 1.f);
}

// Expert parallel (ds4/model/expert_group.py): out[p] = map[idx[p]], a rank's own expert id for
// each global pick, or -1 where another rank holds that expert (the batch MoE skips those).
extern "C" __global__ void moe_localize(const int* __restrict__ map, const int* __restrict__ idx,
                                        int n, int* __restrict__ out) {
    wait_inputs();  // (pdl.py)
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < n) out[p] = map[idx[p]];
}
