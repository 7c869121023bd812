// The mHC unit boundary of decode in one launch (hc_unit; its pieces: hyper_connection.cuh).

#include "common.cuh"
#include "hyper_connection.cuh"

// Decode at an mHC unit boundary, one launch: the previous unit's hc_post (y not null), this
// unit's hc_mix (into mix) and its pre + RMSNorm (h; head: the output head's collapse and
// RMSNorm, pre only). Block s of member z takes channels [s * SLICE, +SLICE) (n <= 4 streams, D
// a multiple of 4) and keeps their new X in shared memory; the member's blocks meet once,
// when every slice's partial mix sums, X^2 and stream products X_i . X_j are in part; then every
// block adds the slices in slice order, so all hold the same mix, pre and sum(u^2) = sum_ij
// pre_i pre_j X_i . X_j (u = sum_i pre_i X_i: no second meeting for the RMSNorm), and writes h
// for its slice. The previous
// unit's post and comb (the Sinkhorn) each block computes from that unit's stored mix
// (prev_mix, with its scale and base) before it waits for the kernel ahead: that mix is two or
// more launches old, and the Sinkhorn then runs in the previous kernel's tail instead of after
// this unit's mix, where a block of its own held the launch open (docs/PERF.md).
// The meeting spins on a per-member count, so every block of the launch must be resident at
// once: 256 threads of at most 64 registers are 4 blocks an SM, and D / SLICE * 8 members
// <= 4 * 132 for D <= MAX_D. The last block to leave resets the member's counts.
constexpr int UNIT_THREADS = 256, SLICE = 128, MAX_MIX = 40;  // MAX_MIX: part slots a slice
constexpr int UNIT_STREAMS = 4, UNIT_WARPS = UNIT_THREADS / 32, MIX_ROWS = 4;  // rows < 32
// a slice's partial slots: its mix rows, from G_SLOT its streams' products X_i . X_j (i <= j,
// row by row), then sum(X^2)
constexpr int GRAM = UNIT_STREAMS * (UNIT_STREAMS + 1) / 2;
constexpr int G_SLOT = MAX_MIX - 1 - GRAM, SS_SLOT = MAX_MIX - 1;

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The block waits until the member's count reaches target (arrive: after adding its own 1, its
// writes made visible first).
__device__ __forceinline__ void member_wait(unsigned* count, unsigned target, bool arrive) {
    if (arrive) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        if (arrive) atomicAdd(count, 1u);
        while (ld_acquire(count) < target) {
        }
    }
    __syncthreads();
}

// The block reads the counts no more; the last of `blocks` to say so resets both.
__device__ __forceinline__ void member_leave(unsigned* count, unsigned blocks) {
    if (threadIdx.x == 0 && atomicAdd(count + 1, 1u) == blocks - 1) {
        count[0] = 0u;
        count[1] = 0u;
    }
}

constexpr int MAX_SLICES = MAX_D / SLICE;

// parts[k * MAX_MIX + r] = the member's partial slots of every slice k < slices, all loads in
// flight at once (a loop that adds as it loads waits one L2 round trip per few slices).
__device__ __forceinline__ void load_parts(const float* pb, int slices, float* parts) {
    constexpr int PER_THREAD = MAX_SLICES * MAX_MIX / UNIT_THREADS;
    float v[PER_THREAD];
#pragma unroll
    for (int j = 0; j < PER_THREAD; j++) {
        int i = threadIdx.x + j * UNIT_THREADS;
        v[j] = i < slices * MAX_MIX ? __ldcg(pb + i) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < PER_THREAD; j++) parts[threadIdx.x + j * UNIT_THREADS] = v[j];
    __syncthreads();
}

// Slot r of the slices' partial sums, added in slice order (every block gets the same bits).
__device__ __forceinline__ float slice_sum(const float* parts, int slices, int r) {
    float t = 0.f;
    for (int k = 0; k < slices; k++) t += parts[k * MAX_MIX + r];
    return t;
}

// mixs[r] = the member's mix row r, the slices' partial sums added in slice order and scaled by
// rsqrt(mean(X^2) + eps) (r < n_mix; every block gets the same values).
__device__ __forceinline__ void whole_mix(const float* pb, int slices, int n_mix, int width,
                                          float mix_eps, float* parts, float* mixs) {
    load_parts(pb, slices, parts);
    if (threadIdx.x < MAX_MIX && (threadIdx.x < n_mix || threadIdx.x == SS_SLOT))
        mixs[threadIdx.x] = slice_sum(parts, slices, threadIdx.x);
    __syncthreads();
    float norm = rsqrtf(mixs[SS_SLOT] / width + mix_eps);  // (mix rows sit below SS_SLOT)
    if (threadIdx.x < n_mix) mixs[threadIdx.x] *= norm;
    __syncthreads();
}

// gred[warp * GRAM + p] = the warp's sum of x_i x_j over its threads' channels, pair p = (i, j),
// i <= j, row by row (xn: a thread's channel of every stream, zeros past n).
__device__ __forceinline__ void stream_products(const float* xn, int lane, int warp,
                                                float* gred) {
    int p = 0;
#pragma unroll
    for (int i = 0; i < UNIT_STREAMS; i++)
#pragma unroll
        for (int j = i; j < UNIT_STREAMS; j++, p++) {
            float t = warp_sum(xn[i] * xn[j]);
            if (lane == 0) gred[warp * GRAM + p] = t;
        }
}

// sum over channels of u^2, u = sum_i pre_i X_i, from the streams' products gram (pairs as
// stream_products): sum_i pre_i^2 G_ii + 2 sum_{i<j} pre_i pre_j G_ij.
__device__ __forceinline__ float sum_u2(const float* pre, const float* gram, int n) {
    float t = 0.f;
    int p = 0;
    for (int i = 0; i < UNIT_STREAMS; i++)
        for (int j = i; j < UNIT_STREAMS; j++, p++)
            if (j < n) t += (i == j ? 1.f : 2.f) * pre[i] * pre[j] * gram[p];
    return t;
}

extern "C" __global__ void __launch_bounds__(UNIT_THREADS, 4)
hc_unit(float* X, const float* __restrict__ y, const float* __restrict__ prev_mix,
        const float* __restrict__ prev_scale, const float* __restrict__ prev_base,
        int prev_stride, const float* __restrict__ fn, const float* __restrict__ scale,
        const float* __restrict__ base, const float* __restrict__ norm_w, float* mix, float* h,
        float* part, unsigned* done, int D, int n, int n_mix, int mix_stride, int iters,
        float eps, float mix_eps, float norm_eps) {
    __shared__ __align__(16) float xsh[UNIT_STREAMS][SLICE];
    __shared__ float red[MAX_MIX], mixs[MAX_MIX], ssr[32], pre[UNIT_STREAMS], rs;
    __shared__ float parts[MAX_SLICES * MAX_MIX];  // the member's partial slots, in turn
    __shared__ float wpre[MAX_STREAMS], post[MAX_STREAMS], comb[MAX_STREAMS * MAX_STREAMS];
    __shared__ float gred[UNIT_WARPS * GRAM], gram[GRAM];
    size_t b = blockIdx.z;
    int slices = (D + SLICE - 1) / SLICE, s = blockIdx.x, width = n * D, c0 = s * SLICE;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = threadIdx.x, d = c0 + c;
    if (c < n_mix * n)  // this slice's fn rows are weights: into the L2 early
        prefetch_l2(fn + (size_t)(c / n) * width + (size_t)(c % n) * D + c0,
                    4u * (unsigned)min(SLICE, D - c0));
    if (y) {  // the previous unit's post and comb, from its mix (written launches ago)
        const float* pm = prev_mix + b * prev_stride;
        if (warp_weights(n)) {
            if (warp == 0) hc_weights_warp(pm, prev_scale, prev_base, n, iters, eps, wpre, post,
                                           comb);
        } else if (threadIdx.x == 0) {
            hc_weights(pm, prev_scale, prev_base, n, iters, eps, wpre, post, comb);
        }
    }
    wait_inputs();  // (pdl.py)
    __syncthreads();  // (post and comb)
    unsigned* count = done + 2 * b;
    float* pb = part + b * slices * MAX_MIX;
    X += b * n * D;
    // the slice's new X (thread c: channel d, all streams) into xsh; X written once all read it
    float xn[MAX_STREAMS] = {}, ss = 0.f;
    bool mine = c < SLICE && d < D;
    if (mine && y) expand_channel(X, y + b * D, post, comb, D, n, d, xn);
#pragma unroll
    for (int i = 0; i < UNIT_STREAMS; i++) {
        if (mine && !y && i < n) xn[i] = X[(size_t)i * D + d];
        if (c < SLICE) xsh[i][c] = i < n ? xn[i] : 0.f;
        ss += xn[i] * xn[i];
    }
    ss = block_sum(ss, ssr);  // (its barriers also order the reads before the writes)
#pragma unroll
    for (int i = 0; i < UNIT_STREAMS; i++)
        if (mine && y && i < n) X[(size_t)i * D + d] = xn[i];
    // partial mix rows: warp w takes rows w, w + 8, .., lane q the channels 4q..4q+3
    float acc[MIX_ROWS] = {};
    int dq = c0 + 4 * lane;
#pragma unroll
    for (int k = 0; k < MIX_ROWS; k++) {
        int r = warp + UNIT_WARPS * k;
        if (r >= n_mix || dq >= D) continue;
#pragma unroll
        for (int i = 0; i < UNIT_STREAMS; i++) {
            if (i >= n) break;
            float4 f = __ldg((const float4*)(fn + (size_t)r * width + (size_t)i * D + dq));
            float4 x = *(const float4*)&xsh[i][4 * lane];
            acc[k] += f.x * x.x + f.y * x.y + f.z * x.z + f.w * x.w;
        }
    }
#pragma unroll
    for (int k = 0; k < MIX_ROWS; k++) {
        float t = warp_sum(acc[k]);
        if (lane == 0) red[warp + UNIT_WARPS * k] = t;
    }
    stream_products(xn, lane, warp, gred);
    __syncthreads();
    if (threadIdx.x < n_mix) pb[s * MAX_MIX + threadIdx.x] = red[threadIdx.x];
    if (threadIdx.x == 0) pb[s * MAX_MIX + SS_SLOT] = ss;
    if (threadIdx.x >= 32 && threadIdx.x < 32 + GRAM) {  // the block's products, in warp order
        float t = 0.f;
        for (int w = 0; w < UNIT_WARPS; w++) t += gred[w * GRAM + threadIdx.x - 32];
        pb[s * MAX_MIX + G_SLOT + threadIdx.x - 32] = t;
    }
    member_wait(count, slices, true);
    whole_mix(pb, slices, n_mix, width, mix_eps, parts, mixs);
    if (s == 0 && threadIdx.x < n_mix) mix[b * mix_stride + threadIdx.x] = mixs[threadIdx.x];
    if (threadIdx.x < n)  // hc_weights_warp's expression for pre, bit for bit
        pre[threadIdx.x] = sigmoidf(mixs[threadIdx.x] * scale[0] + base[threadIdx.x]) + eps;
    if (threadIdx.x >= 32 && threadIdx.x < 32 + GRAM)  // (a second warp, beside pre)
        gram[threadIdx.x - 32] = slice_sum(parts, slices, G_SLOT + threadIdx.x - 32);
    __syncthreads();
    if (threadIdx.x == 0) rs = rsqrtf(sum_u2(pre, gram, n) / D + norm_eps);
    __syncthreads();
    float u = 0.f;
#pragma unroll
    for (int i = 0; i < UNIT_STREAMS; i++)
        if (mine && i < n) u += pre[i] * xsh[i][c];
    if (mine) h[b * D + d] = u * rs * norm_w[d];
    member_leave(count, slices);
}
