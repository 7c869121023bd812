// The router's pick of one token's experts (moe.cu's moe_route): s = sqrt(softplus(logit));
// the top_k experts by s + bias (bias may be null), or tid2eid[token] (hash layers, when
// tid2eid is given); weights w = s[idx] / sum * route_scale.
#pragma once

#include "common.cuh"

// One warp per token, lane l holding experts l, l + 32, .. (n_experts <= 32 * ROUTE_SLOTS,
// top_k <= 32): a pick is one warp argmax, no block barrier (a block of n_experts threads
// spent most of its time meeting at two barriers a pick).
constexpr int ROUTE_SLOTS = 32;

// The lane's value of slot j (a register array indexed by a run-time j, kept in registers).
__device__ __forceinline__ float slot_of(const float (&v)[ROUTE_SLOTS], int j) {
    float out = 0.f;
#pragma unroll
    for (int s = 0; s < ROUTE_SLOTS; s++)
        if (s == j) out = v[s];
    return out;
}

// idx[r], wts[r] for r < top_k of the token whose router logits these are, by the calling
// warp.
__device__ __forceinline__ void route_member(const float* logits, const float* bias,
                                             const int* tid2eid, const int* token,
                                             int n_experts, int top_k, float route_scale,
                                             int* idx, float* wts) {
    int lane = threadIdx.x & 31;
    float score[ROUTE_SLOTS], choice[ROUTE_SLOTS];
#pragma unroll
    for (int j = 0; j < ROUTE_SLOTS; j++) {
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
            e = tid2eid[(size_t)token[0] * top_k + r];
        } else {  // the largest choice, ties to the lower expert
            float v = choice[0];
            e = lane;
#pragma unroll
            for (int j = 1; j < ROUTE_SLOTS; j++)
                if (choice[j] > v) { v = choice[j]; e = lane + 32 * j; }
            warp_argmax(v, e);
#pragma unroll
            for (int j = 0; j < ROUTE_SLOTS; j++)
                if (lane + 32 * j == e) choice[j] = -INFINITY;
        }
        float s = __shfl_sync(0xffffffffu, slot_of(score, e >> 5), e & 31);
        total += s;  // in pick order
        if (lane == r) { mine = e; mine_s = s; }
    }
    if (lane < top_k) {
        idx[lane] = mine;
        wts[lane] = mine_s / (total + 1e-20f) * route_scale;
    }
}
