// The MTP block's own kernels (docs/ARCHITECTURE.md, Speculative decoding): decode attention of
// one query over the block's sliding window, whose ring is sparse (only drafted positions wrote
// rows, and rejected drafts' rows were put back), plus the token's new K=V row; and the draft's
// pick (argmax and its margin over the runner-up), so a draft reads back 12 bytes, not logits.
//
// The window lives in the session; its address and the position each ring slot holds come from
// a small table the host fills before each replay of the draft graph ([pos, token] int32, the
// ring's address, then held int32 [cap]), so the graph holds no session's address.

#include "common.cuh"

// A ring slot holding position p is a key of the query at t when t - cap < p <= t (p = -1:
// the slot is empty).
__device__ __forceinline__ bool held_visible(int p, int t, int cap) {
    return p >= 0 && p <= t && p > t - cap;
}

// Flash-decoding split over keys 0..cap: ring slot j for j < cap, and the new row kv as key cap
// (always visible). Block (g, s) takes heads [g * hpb, (g + 1) * hpb) (hpb <= 8) and keys
// [s * 32, (s + 1) * 32), keeps only the visible ones (in key order), stages them once in shared
// memory and writes per head [m, l, o...] into part[(h * splits + s) * (width + 2)], the layout
// attention_combine (ds4/kernels/attention.cu) reads; a split with no visible key writes
// m = -inf, l = 0, o = 0, which the combine weighs 0. 256 threads; dynamic shared memory:
// 32 * key_stride(width) key floats, hpb * width query floats, hpb * 32 weights and 32 key row
// addresses.
extern "C" __global__ void mtp_window_partial(const float* __restrict__ q,
                                              const long long* __restrict__ raw_ptr,
                                              const int* __restrict__ held,
                                              const float* __restrict__ kv,
                                              const int* __restrict__ pos, int cap, float* part,
                                              int width, float scale, int hpb) {
    wait_inputs();  // (pdl.py)
    extern __shared__ float smem[];
    __shared__ int visible_count;
    int stride = key_stride(width);
    float* ks = smem;
    float* qs = ks + SPLIT_KEYS * stride;
    float* ps = qs + hpb * width;
    const float** rows = (const float**)(ps + hpb * SPLIT_KEYS);  // the visible keys' rows
    const float* raw = (const float*)raw_ptr[0];
    int h0 = blockIdx.x * hpb, split = blockIdx.y, splits = gridDim.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int t = pos[0];
    if (warp == 0) {  // compact this split's visible keys, keeping their order
        int j = split * SPLIT_KEYS + lane;
        bool vis = j < cap ? held_visible(held[j], t, cap) : j == cap;
        unsigned mask = __ballot_sync(0xffffffffu, vis);
        if (vis) rows[__popc(mask & ((1u << lane) - 1u))] = j < cap ? raw + (size_t)j * width : kv;
        if (lane == 0) visible_count = __popc(mask);
    }
    const float4* q4 = (const float4*)(q + (size_t)h0 * width);
    for (int i = threadIdx.x; i < hpb * width / 4; i += blockDim.x) ((float4*)qs)[i] = q4[i];
    __syncthreads();
    int count = visible_count;
    stage_key_rows(ks, rows, count, width, stride);
    __syncthreads();
    staged_partial(qs, ks, ps, stride, width, count, hpb, scale, part, h0, split, splits);
}

// The new row into the window after the attention read it: ring[pos % cap] = kv.
extern "C" __global__ void mtp_window_store(const float* __restrict__ kv,
                                            const long long* __restrict__ raw_ptr,
                                            const int* __restrict__ pos, int cap, int width) {
    wait_inputs();  // (pdl.py)
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < width) ((float*)raw_ptr[0])[(size_t)(pos[0] % cap) * width + c] = kv[c];
}

// (best, its index, the largest other value) merged with another triple: the lower index wins a
// tie, and the loser's best becomes a candidate runner-up (equal to best on a tie: margin 0).
__device__ __forceinline__ void merge_top(float& best, int& idx, float& second, float b, int i,
                                          float s) {
    if (b > best || (b == best && i < idx)) {
        second = fmaxf(s, best);
        best = b;
        idx = i;
    } else {
        second = fmaxf(second, b);
    }
}

// out = [argmax of x[0..n) (lowest index on ties), bits of its value, bits of the largest
// value at any other index]. One block of 1024 threads.
extern "C" __global__ void mtp_top_gap(const float* __restrict__ x, int n, int* out) {
    wait_inputs();  // (pdl.py)
    __shared__ float bests[32], seconds[32];
    __shared__ int idxs[32];
    float best = -INFINITY, second = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        merge_top(best, idx, second, x[i], i, -INFINITY);
    for (int o = 16; o > 0; o >>= 1) {
        float b = __shfl_xor_sync(0xffffffffu, best, o);
        int i = __shfl_xor_sync(0xffffffffu, idx, o);
        float s = __shfl_xor_sync(0xffffffffu, second, o);
        merge_top(best, idx, second, b, i, s);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        bests[warp] = best;
        idxs[warp] = idx;
        seconds[warp] = second;
    }
    __syncthreads();
    if (warp != 0) return;
    int warps = blockDim.x >> 5;
    best = lane < warps ? bests[lane] : -INFINITY;
    idx = lane < warps ? idxs[lane] : 0x7fffffff;
    second = lane < warps ? seconds[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) {
        float b = __shfl_xor_sync(0xffffffffu, best, o);
        int i = __shfl_xor_sync(0xffffffffu, idx, o);
        float s = __shfl_xor_sync(0xffffffffu, second, o);
        merge_top(best, idx, second, b, i, s);
    }
    if (lane == 0) {
        out[0] = idx;
        out[1] = __float_as_int(best);
        out[2] = __float_as_int(second);
    }
}
