// mHC hyper-connections (docs/MODEL.md, Hyper-connections), all fp32. X is the residual state
// [streams, D]; mix = (fn @ flatten(X)) * rsqrt(mean(X^2) + eps); pre/post/comb come from mix.

#include "common.cuh"

#define MAX_STREAMS 8

__device__ __forceinline__ float sigmoidf(float v) { return 1.f / (1.f + expf(-v)); }

// X[i, :] = embed[token] for every stream i: the residual starts as the token embedding.
template <typename W>
__device__ void embed(const W* table, const int* token, float* X, int D, int streams) {
    token += blockIdx.z;  // member blockIdx.z of a batch: token [B], X [B, streams, D]
    X += (size_t)blockIdx.z * streams * D;
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    float v = widen(table[(size_t)token[0] * D + d]);
    for (int i = 0; i < streams; i++) X[(size_t)i * D + d] = v;
}

extern "C" __global__ void embed_streams_bf16(const unsigned short* __restrict__ table,
                                              const int* __restrict__ token, float* X, int D,
                                              int streams) {
    wait_inputs();  // (pdl.py)
    embed(table, token, X, D, streams);
}

extern "C" __global__ void embed_streams_f32(const float* __restrict__ table,
                                             const int* __restrict__ token, float* X, int D,
                                             int streams) {
    wait_inputs();  // (pdl.py)
    embed(table, token, X, D, streams);
}

// mix[row] = fn[row, :] . x * rsqrt(mean(x^2) + eps); one block per mix row, x = flatten(X).
extern "C" __global__ void hc_mix(const float* __restrict__ fn, const float* __restrict__ X,
                                  float* mix, int width, float eps, int mix_stride) {
    wait_inputs();  // (pdl.py)
    __shared__ float shared[32];
    const float4* f = (const float4*)(fn + (size_t)blockIdx.x * width);
    // member blockIdx.z of a batch: X [B, width], mix [B, mix_stride]
    const float4* x = (const float4*)(X + (size_t)blockIdx.z * width);
    mix += (size_t)blockIdx.z * mix_stride;
    float dot = 0.f, ss = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < width / 4; i += blockDim.x) {
        float4 a = f[i], b = x[i];
        dot += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
        ss += b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
    }
    dot = block_sum(dot, shared);
    ss = block_sum(ss, shared);
    if (threadIdx.x == 0) mix[blockIdx.x] = dot * rsqrtf(ss / width + eps);
}

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

// u = sum_i pre[i] X[i]. Every block derives the (tiny) weights itself; block 0 also stores
// post (n values) then comb (n*n) into post_comb for hc_post. head != 0: the output head's
// collapse, whose mix has only the n pre values (no post, no comb).
extern "C" __global__ void hc_pre(const float* __restrict__ mix, const float* __restrict__ scale,
                                  const float* __restrict__ base, const float* __restrict__ X,
                                  float* u, float* post_comb, int D, int n, int iters, float eps,
                                  int head) {
    wait_inputs();  // (pdl.py)
    __shared__ float pre[MAX_STREAMS], post[MAX_STREAMS], comb[MAX_STREAMS * MAX_STREAMS];
    size_t b = blockIdx.z;  // member of a batch: every operand [B, ...] (head: mix [B, n])
    mix += b * (head ? n : (2 + n) * n);
    X += b * n * D;
    u += b * D;
    post_comb += b * (n + n * n);
    bool warp_path = warp_weights(n);
    if (head) {
        if (threadIdx.x < n) pre[threadIdx.x] = sigmoidf(mix[threadIdx.x] * scale[0] + base[threadIdx.x]) + eps;
    } else if (warp_path) {
        if (threadIdx.x < 32) hc_weights_warp(mix, scale, base, n, iters, eps, pre, post, comb);
    } else if (threadIdx.x == 0) {
        hc_weights(mix, scale, base, n, iters, eps, pre, post, comb);
    }
    __syncthreads();
    if (!head && blockIdx.x == 0) {
        for (int i = threadIdx.x; i < n + n * n; i += blockDim.x)
            post_comb[i] = i < n ? post[i] : comb[i - n];
    }
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    float acc = 0.f;
    for (int i = 0; i < n; i++) acc += pre[i] * X[(size_t)i * D + d];
    u[d] = acc;
}

// Prefill: pre, post and comb for each of `rows` tokens, one thread per token running the
// serial weights (the chunk's tokens are the parallelism). mix is [rows, (2 + n) * n];
// out[r] = [pre (n), post (n), comb (n * n)].
extern "C" __global__ void hc_weights_rows(const float* __restrict__ mix,
                                           const float* __restrict__ scale,
                                           const float* __restrict__ base, float* out, int rows,
                                           int n, int iters, float eps) {
    wait_inputs();  // (pdl.py)
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float pre[MAX_STREAMS], post[MAX_STREAMS], comb[MAX_STREAMS * MAX_STREAMS];
    hc_weights(mix + (size_t)r * (2 + n) * n, scale, base, n, iters, eps, pre, post, comb);
    float* o = out + (size_t)r * (2 + n) * n;
    for (int i = 0; i < n; i++) {
        o[i] = pre[i];
        o[n + i] = post[i];
    }
    for (int i = 0; i < n * n; i++) o[2 * n + i] = comb[i];
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

// expand_channel stored to Xout (which may alias X).
__device__ __forceinline__ void expand_streams(const float* X, const float* y, const float* post,
                                               const float* comb, float* Xout, int D, int n,
                                               int d) {
    float xn[MAX_STREAMS];
    expand_channel(X, y, post, comb, D, n, d, xn);
    for (int j = 0; j < n; j++) Xout[(size_t)j * D + d] = xn[j];
}

// Decode: one token; post_comb = [post (n), comb (n*n)] as hc_pre stored it.
extern "C" __global__ void hc_post(const float* X, const float* __restrict__ y,
                                   const float* __restrict__ post_comb, float* Xout, int D, int n) {
    wait_inputs();  // (pdl.py)
    size_t b = blockIdx.z;  // member of a batch: X, Xout [B, n, D], y [B, D], post_comb [B, .]
    X += b * n * D;
    Xout += b * n * D;
    y += b * D;
    post_comb += b * (n + n * n);
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d < D) expand_streams(X, y, post_comb, post_comb + n, Xout, D, n, d);
}

// Prefill: token r = blockIdx.y with its own post [rows, n] and comb [rows, n, n]; X and Xout
// are [rows, n, D].
extern "C" __global__ void hc_post_rows(const float* X, const float* __restrict__ y,
                                        const float* __restrict__ post,
                                        const float* __restrict__ comb, float* Xout, int D, int n) {
    wait_inputs();  // (pdl.py)
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    size_t r = blockIdx.y;
    if (d < D) expand_streams(X + r * n * D, y + r * D, post + r * n, comb + r * n * n,
                              Xout + r * n * D, D, n, d);
}

// Sum of v over the first `threads` threads of the block (whole warps; the others never call
// it), through named barrier 1; `shared` holds 32 floats. Every caller gets the result.
__device__ __forceinline__ float group_sum(float v, float* shared, int threads) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) shared[warp] = v;
    asm volatile("bar.sync 1, %0;" ::"r"(threads));
    if (warp == 0) {
        float t = lane < threads / 32 ? shared[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) shared[31] = t;
    }
    asm volatile("bar.sync 1, %0;" ::"r"(threads));
    return shared[31];
}


// u = sum_i p_i X_i over the first `threads` threads into us (D floats of shared memory), then
// h = u * rsqrt(mean(u^2) + norm_eps) * norm_w. X is read through L2 (other blocks of the
// launch may have written it: hc_unit).
__device__ __forceinline__ void collapse_sum_norm(const float* p, const float* X,
                                                  const float* __restrict__ norm_w, float* h,
                                                  float* us, float* red, int D, int n,
                                                  float norm_eps, int threads) {
    float ss = 0.f;
#pragma unroll 4
    for (int d = threadIdx.x; d < D; d += threads) {
        float u = 0.f;
#pragma unroll
        for (int i = 0; i < MAX_STREAMS; i++)
            if (i < n) u += p[i] * __ldcg(X + (size_t)i * D + d);
        us[d] = u;
        ss += u * u;
    }
    float r = rsqrtf(group_sum(ss, red, threads) / D + norm_eps);
    for (int d = threadIdx.x; d < D; d += threads) h[d] = us[d] * r * norm_w[d];
}

// The weights of one unit from its mix, the collapse u = sum_i pre_i X_i and its RMSNorm h, by
// one block (member pointers already offset; us: D floats of shared memory). Where one warp
// computes the weights (warp_weights), the last warp runs the Sinkhorn (only comb needs it)
// while the others, each deriving pre itself by the same expression, sum and
// normalise: the two overlap instead of following each other. head: the output head's
// collapse (mix holds the n pre values only; no post, no comb).
__device__ void collapse_norm(const float* mix, const float* __restrict__ scale,
                              const float* __restrict__ base, const float* X,
                              const float* __restrict__ norm_w, float* h, float* post_comb,
                              int D, int n, int iters, float eps, float norm_eps, bool head,
                              float* us) {
    __shared__ float pre[MAX_STREAMS], post[MAX_STREAMS], comb[MAX_STREAMS * MAX_STREAMS];
    __shared__ float red[32], pre_sum[MAX_STREAMS];  // pre_sum: the summing warps' own copy
    int threads = blockDim.x - 32;
    const float* p = pre_sum;
    if (head || !warp_weights(n)) {  // weights first, then every thread sums
        if (head && threadIdx.x < (unsigned)n)
            pre_sum[threadIdx.x] = sigmoidf(mix[threadIdx.x] * scale[0] + base[threadIdx.x]) + eps;
        if (!head && threadIdx.x == 0)
            hc_weights(mix, scale, base, n, iters, eps, pre, post, comb);
        __syncthreads();
        for (int i = threadIdx.x; !head && i < n + n * n; i += blockDim.x)
            post_comb[i] = i < n ? post[i] : comb[i - n];
        threads = blockDim.x;
        p = head ? pre_sum : pre;
    } else if ((int)threadIdx.x >= threads) {  // the last warp: pre, post and the Sinkhorn
        hc_weights_warp(mix, scale, base, n, iters, eps, pre, post, comb);
        __syncwarp();
        for (int i = threadIdx.x - threads; i < n + n * n; i += 32)
            post_comb[i] = i < n ? post[i] : comb[i - n];
        return;
    } else {
        if (threadIdx.x < (unsigned)n)  // hc_weights_warp's expression for pre, bit for bit
            pre_sum[threadIdx.x] = sigmoidf(mix[threadIdx.x] * scale[0] + base[threadIdx.x]) + eps;
        asm volatile("bar.sync 1, %0;" ::"r"(threads));
    }
    collapse_sum_norm(p, X, norm_w, h, us, red, D, n, norm_eps, threads);
}

constexpr int MAX_D = 8192;  // channels the collapse keeps in shared memory

// hc_pre and the sub-block's RMSNorm in one block of 1024 threads (D <= MAX_D):
// u = sum_i pre_i X_i, h = u * rsqrt(mean(u^2) + norm_eps) * norm_w; post/comb as hc_pre.
extern "C" __global__ void hc_pre_norm(const float* __restrict__ mix,
                                       const float* __restrict__ scale,
                                       const float* __restrict__ base, const float* __restrict__ X,
                                       const float* __restrict__ norm_w, float* h,
                                       float* post_comb, int D, int n, int iters, float eps,
                                       float norm_eps) {
    wait_inputs();  // (pdl.py)
    __shared__ float us[MAX_D];
    size_t b = blockIdx.z;  // member of a batch: every operand [B, ...]
    collapse_norm(mix + b * (2 + n) * n, scale, base, X + b * n * D, norm_w, h + b * D,
                  post_comb + b * (n + n * n), D, n, iters, eps, norm_eps, false, us);
}

// Decode at an mHC unit boundary, one launch: the previous unit's hc_post (y not null), this
// unit's hc_mix (into mix) and its pre + RMSNorm (h; post_comb; head: the output head's collapse
// and RMSNorm, pre only). Block s < slices of member z takes channels [s * SLICE, +SLICE) (n <= 4
// streams, D a multiple of 4) and keeps their new X in shared memory; the member's blocks meet
// twice: once every slice's partial mix sums and X^2 are in part (then every block adds the
// slices in slice order, so all hold the same mix and pre), and once every slice's share of
// sum(u^2) is (u = sum_i pre_i X_i, each block its own channels); each then writes h for its
// slice. Block `slices` (not for the head) takes post and comb, with the Sinkhorn, off that path.
// The meetings spin on a per-member count, so every block of the launch must be resident at
// once: 256 threads of at most 64 registers are 4 blocks an SM, and (D / SLICE + 1) * 8 members
// <= 4 * 132 for D <= MAX_D. The last block to leave resets the member's counts.
constexpr int UNIT_THREADS = 256, SLICE = 128, MAX_MIX = 32;  // MAX_MIX: part slots a slice
constexpr int UNIT_STREAMS = 4, UNIT_WARPS = UNIT_THREADS / 32, MIX_ROWS = MAX_MIX / UNIT_WARPS;
constexpr int U_SLOT = MAX_MIX - 2, SS_SLOT = MAX_MIX - 1;  // sum(u^2), sum(X^2); mix rows below

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

extern "C" __global__ void __launch_bounds__(UNIT_THREADS, 4)
hc_unit(float* X, const float* __restrict__ y, float* post_comb, const float* __restrict__ fn,
        const float* __restrict__ scale, const float* __restrict__ base,
        const float* __restrict__ norm_w, float* mix, float* h, float* part, unsigned* done, int D,
        int n, int n_mix, int mix_stride, int iters, float eps, float mix_eps, float norm_eps,
        int head) {
    __shared__ __align__(16) float xsh[UNIT_STREAMS][SLICE];
    __shared__ float red[MAX_MIX], mixs[MAX_MIX], ssr[32], pre[UNIT_STREAMS], rs;
    __shared__ float parts[MAX_SLICES * MAX_MIX];  // the member's partial slots, in turn
    size_t b = blockIdx.z;
    int slices = (D + SLICE - 1) / SLICE, s = blockIdx.x, width = n * D, c0 = s * SLICE;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = threadIdx.x, d = c0 + c;
    if (s < slices && c < n_mix * n)  // this slice's fn rows are weights: into the L2 early
        prefetch_l2(fn + (size_t)(c / n) * width + (size_t)(c % n) * D + c0,
                    4u * (unsigned)min(SLICE, D - c0));
    wait_inputs();  // (pdl.py)
    unsigned* count = done + 2 * b;
    float* pb = part + b * slices * MAX_MIX;
    post_comb += b * (n + n * n);
    if (s == slices) {  // post and comb once the mix is whole
        member_wait(count, slices, false);
        whole_mix(pb, slices, n_mix, width, mix_eps, parts, mixs);
        __shared__ float wpre[MAX_STREAMS], post[MAX_STREAMS], comb[MAX_STREAMS * MAX_STREAMS];
        if (warp_weights(n)) {
            if (warp == 0) hc_weights_warp(mixs, scale, base, n, iters, eps, wpre, post, comb);
        } else if (threadIdx.x == 0) {
            hc_weights(mixs, scale, base, n, iters, eps, wpre, post, comb);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n + n * n; i += UNIT_THREADS)
            post_comb[i] = i < n ? post[i] : comb[i - n];
        member_leave(count, slices + 1);
        return;
    }
    X += b * n * D;
    // the slice's new X (thread c: channel d, all streams) into xsh; X written once all read it
    float xn[MAX_STREAMS] = {}, ss = 0.f;
    bool mine = c < SLICE && d < D;
    if (mine && y) expand_channel(X, y + b * D, post_comb, post_comb + n, D, n, d, xn);
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
    __syncthreads();
    if (threadIdx.x < n_mix) pb[s * MAX_MIX + threadIdx.x] = red[threadIdx.x];
    if (threadIdx.x == 0) pb[s * MAX_MIX + SS_SLOT] = ss;
    member_wait(count, slices, true);
    whole_mix(pb, slices, n_mix, width, mix_eps, parts, mixs);
    if (s == 0 && threadIdx.x < n_mix) mix[b * mix_stride + threadIdx.x] = mixs[threadIdx.x];
    if (threadIdx.x < n)  // hc_weights_warp's expression for pre, bit for bit
        pre[threadIdx.x] = sigmoidf(mixs[threadIdx.x] * scale[0] + base[threadIdx.x]) + eps;
    __syncthreads();
    float u = 0.f;
#pragma unroll
    for (int i = 0; i < UNIT_STREAMS; i++)
        if (mine && i < n) u += pre[i] * xsh[i][c];
    float uss = block_sum(u * u, ssr);
    if (threadIdx.x == 0) pb[s * MAX_MIX + U_SLOT] = uss;
    member_wait(count, 2 * slices, true);
    load_parts(pb, slices, parts);  // (whole_mix's reads of parts ended at its last barrier)
    if (threadIdx.x == 0) rs = rsqrtf(slice_sum(parts, slices, U_SLOT) / D + norm_eps);
    __syncthreads();
    if (mine) h[b * D + d] = u * rs * norm_w[d];
    member_leave(count, slices + (head ? 0 : 1));
}
