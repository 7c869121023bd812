// mHC hyper-connections (docs/MODEL.md, Hyper-connections), all fp32. X is the residual state
// [streams, D]; mix = (fn @ flatten(X)) * rsqrt(mean(X^2) + eps); pre/post/comb come from mix.

#include "common.cuh"
#include "hyper_connection.cuh"

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
        if (threadIdx.x < n)
            pre[threadIdx.x] = sigmoidf(mix[threadIdx.x] * scale[0] + base[threadIdx.x]) + eps;
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
