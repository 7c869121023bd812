// Selection on the device: greedy argmax over logits and the top-k entry set used by the indexer
// (and by top-k sampling). Ties go to the lower index, as ds4/sampling.py does.

#include "common.cuh"

// Order-preserving map of a float to an unsigned key (larger float -> larger key).
__device__ __forceinline__ unsigned int order_key(float f) {
    unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Argmax of each row x[b * ld .. b * ld + n) into out[b]; one block of 1024 threads a row.
// Rows of 16-byte aligned groups of four are read as float4, four loads in flight a thread (a
// vocabulary row is ~0.5 MB: scalar loads one at a time left one SM waiting ~25 us on it). A
// thread visits its entries in increasing index and keeps the first maximum; the reduction then
// takes the lowest index among equal values, so ties go to the lowest index either way.
extern "C" __global__ void argmax(const float* __restrict__ x, int n, int* out, long long ld) {
    wait_inputs();  // (pdl.py)
    __shared__ float bv[32];
    __shared__ int bi[32];
    x += blockIdx.x * ld;
    out += blockIdx.x;
    float v = -INFINITY;
    int idx = 0x7fffffff, start = 0;
    if ((((size_t)x) & 15) == 0) {
        const float4* x4 = (const float4*)x;
        int n4 = n / 4;
#pragma unroll 4
        for (int i = threadIdx.x; i < n4; i += blockDim.x) {
            float4 f = x4[i];
            if (f.x > v) { v = f.x; idx = 4 * i; }
            if (f.y > v) { v = f.y; idx = 4 * i + 1; }
            if (f.z > v) { v = f.z; idx = 4 * i + 2; }
            if (f.w > v) { v = f.w; idx = 4 * i + 3; }
        }
        start = 4 * n4;
    }
    for (int i = start + threadIdx.x; i < n; i += blockDim.x) {
        if (x[i] > v) { v = x[i]; idx = i; }
    }
    warp_argmax(v, idx);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { bv[warp] = v; bi[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        v = lane < nw ? bv[lane] : -INFINITY;
        idx = lane < nw ? bi[lane] : 0x7fffffff;
        warp_argmax(v, idx);
        if (lane == 0) out[0] = idx == 0x7fffffff ? 0 : idx;  // every entry -inf: 0, as NumPy
    }
}

// Exclusive prefix sum of v over the block (warp scans, then the warp totals in warp order);
// returns this thread's offset and stores the block total in *total. Every thread calls it.
__device__ int block_exclusive_sum(int v, int* warp_sums, int* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, run = v;
    for (int o = 1; o < 32; o <<= 1) {
        int up = __shfl_up_sync(0xffffffffu, run, o);
        if (lane >= o) run += up;
    }
    __syncthreads();  // a previous call's readers of warp_sums are done
    if (lane == 31) warp_sums[warp] = run;
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
            int c = warp_sums[w];
            warp_sums[w] = acc;
            acc += c;
        }
        *total = acc;
    }
    __syncthreads();
    return warp_sums[warp] + run - v;
}

// topk_select's list: the indices of x[0..n) whose key is above thresh, and the first eq_need
// of those equal to it, in ascending order into sel. Warp w takes the w-th contiguous chunk
// (whole rounds of 32, its lanes' loads side by side): it counts both kinds, two block scans
// give it the equal keys before its chunk and its first slot, then it lists its entries
// round by round (ballots order them inside a round).
__device__ void select_listed(const float* x, int n, unsigned int thresh, int eq_need, int* sel,
                              int* warp_sums, int* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int per = (n + 32 * warps - 1) / (32 * warps) * 32;
    int lo = min(n, warp * per), hi = min(n, lo + per), gt = 0, eq = 0;
    for (int i = lo + lane; i < hi; i += 32) {
        unsigned int key = order_key(x[i]);
        gt += key > thresh;
        eq += key == thresh;
    }
    gt = warp_sum(gt);
    eq = warp_sum(eq);
    int eq_before = block_exclusive_sum(lane == 0 ? eq : 0, warp_sums, total);
    eq_before = __shfl_sync(0xffffffffu, eq_before, 0);
    int eq_take = max(0, min(eq, eq_need - eq_before));
    int at = block_exclusive_sum(lane == 0 ? gt + eq_take : 0, warp_sums, total);
    at = __shfl_sync(0xffffffffu, at, 0);
    unsigned int below = (1u << lane) - 1u;
    for (int base = lo; base < hi; base += 32) {  // (the warp's rounds: every lane runs each)
        int i = base + lane;
        unsigned int key = i < hi ? order_key(x[i]) : 0u;
        bool is_eq = i < hi && key == thresh;
        unsigned int eqs = __ballot_sync(0xffffffffu, is_eq);
        bool take = (i < hi && key > thresh) || (is_eq && __popc(eqs & below) < eq_take);
        unsigned int takes = __ballot_sync(0xffffffffu, take);
        if (take) sel[at + __popc(takes & below)] = i;
        at += __popc(takes);
        eq_take -= min(eq_take, __popc(eqs));
    }
}

// The k largest of x[0..n) as indices in ascending index order, into sel[0..count), count into
// sel_count[0]. n is (pos[0] + 1) / ratio when pos is given, else n_fixed. A 4-pass radix select
// finds the k-th largest key; entries equal to it are taken lowest index first. One block of 1024.
// The list is written in one pass over contiguous chunks, a chunk a warp, placed by two block
// scans (a scan every 1024 entries took 228 against 153 us on a vocabulary row; docs/PERF.md).
extern "C" __global__ void topk_select(const float* __restrict__ x, const int* __restrict__ pos,
                                       int ratio, int n_fixed, int k, int* sel, int* sel_count,
                                       int x_stride) {
    wait_inputs();  // (pdl.py)
    // member blockIdx.z of a batch: x [B, x_stride], sel [B, k], sel_count [B], pos [B]
    x += (size_t)blockIdx.z * x_stride;
    sel += (size_t)blockIdx.z * k;
    sel_count += blockIdx.z;
    if (pos) pos += blockIdx.z;
    __shared__ int hist[256];
    __shared__ int warp_sums[32];
    __shared__ unsigned int prefix_s, mask_s;
    __shared__ int remaining_s, total_s;
    int n = pos ? (pos[0] + 1) / ratio : n_fixed;
    if (n <= k) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) sel[i] = i;
        if (threadIdx.x == 0) sel_count[0] = n;
        return;
    }
    int lane = threadIdx.x & 31;
    if (threadIdx.x == 0) { prefix_s = 0; mask_s = 0; remaining_s = k; }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        unsigned int prefix = prefix_s, mask = mask_s;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            unsigned int key = order_key(x[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x < 32) {  // one warp finds the bucket holding the need-th largest key
            int need = remaining_s, own = 0;
            for (int b = 0; b < 8; b++) own += hist[255 - 8 * lane - b];  // lane 0: top buckets
            int incl = own;
            for (int o = 1; o < 32; o <<= 1) {
                int up = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += up;
            }
            unsigned int hit = __ballot_sync(0xffffffffu, incl >= need);
            int owner = __ffs(hit) - 1;
            if (lane == owner) {
                int left = need - (incl - own), d = 255 - 8 * lane;
                while (hist[d] < left) { left -= hist[d]; d--; }
                remaining_s = left;  // how many of the keys in bucket d we still take
                prefix_s = prefix | ((unsigned int)d << shift);
                mask_s = mask | (255u << shift);
            }
        }
        __syncthreads();
    }
    select_listed(x, n, prefix_s, remaining_s, sel, warp_sums, &total_s);
    if (threadIdx.x == 0) sel_count[0] = k;
}

// A draw under temperature, min_p and top_p (ds4/sampling.py's host path, the same
// arithmetic) from a row x[0..n), or from the candidates x[sel[0..n)] (top_k's, by topk_select,
// ascending ids): s = (x - max) / T in float32, the candidates with s >= floor (= log min_p)
// kept in id order, their weights exp(s) in float64 summed one after another, and the first
// whose running sum exceeds u * total drawn. One block of 1024 threads: thread t scans the t-th
// contiguous chunk twice (count, then list its kept ones at its offset), so the list comes out
// in id order. top_p < 1 (top_p_cut) then keeps only the best of those (top_p and min_p each
// keep a prefix of the ranked candidates, so ranking min_p's few survivors suffices). None or
// more than MIN_P_KEPT kept: out[0] = -1 (the caller takes the masked path).
constexpr int MIN_P_KEPT = 2048;

// The candidates: a row, or the entries sel lists.
struct Candidates {
    const float* x;
    const int* sel;
    __device__ float operator[](int i) const { return x[sel ? sel[i] : i]; }
    __device__ int id(int i) const { return sel ? sel[i] : i; }
};

// The top_p cut over the kept candidates ids[0..kept) (id order): rank them by s descending,
// ties to the lower id, and zero the weight w[j] of each one past the shortest ranked prefix
// whose share of all n candidates' mass reaches top_p. Returns (to thread 0) the last kept j.
__device__ int top_p_cut(Candidates x, int n, float m, float T, double top_p, const int* ids,
                         int kept, double* w, float* s, int* rank, double* red, int* limit) {
    double part = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) part += exp((double)((x[i] - m) / T));
    double mass = block_sum(part, red);  // all candidates'
    for (int j = threadIdx.x; j < kept; j += blockDim.x) s[j] = (x[ids[j]] - m) / T;
    __syncthreads();
    for (int j = threadIdx.x; j < kept; j += blockDim.x) {
        int r = 0;
        for (int i = 0; i < kept; i++) r += s[i] > s[j] || (s[i] == s[j] && i < j);
        rank[j] = r;
        w[r] = exp((double)s[j]);  // in rank order, for the running share
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the first rank whose share reaches top_p (searchsorted, left)
        double run = 0.0;
        int r = 0;
        while (r < kept - 1 && (run += w[r]) / mass < top_p) r++;
        *limit = r + 1;
    }
    __syncthreads();
    int last = 0;  // (thread 0's: the only one that draws)
    if (threadIdx.x == 0)
        for (int j = 0; j < kept; j++) last = rank[j] < *limit ? j : last;
    for (int j = threadIdx.x; j < kept; j += blockDim.x)
        w[j] = rank[j] < *limit ? exp((double)s[j]) : 0.0;  // zeros add nothing: same sums
    __syncthreads();
    return last;
}

extern "C" __global__ void sample_min_p(const float* __restrict__ row, const int* __restrict__ sel,
                                        int n, float T, float floor, double u, double top_p,
                                        int* out) {
    wait_inputs();  // (pdl.py)
    __shared__ float red[32];
    __shared__ double red64[32];
    __shared__ int counts[32], total, limit;
    __shared__ int ids[MIN_P_KEPT], rank[MIN_P_KEPT];
    __shared__ float s[MIN_P_KEPT];
    __shared__ double cdf[MIN_P_KEPT];
    Candidates x{row, sel};
    float m = -INFINITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, x[i]);
    m = block_max(m, red);
    int per = (n + blockDim.x - 1) / blockDim.x, lo = min(n, (int)threadIdx.x * per);
    int hi = min(n, lo + per), mine = 0;
    for (int i = lo; i < hi; i++) mine += (x[i] - m) / T >= floor;
    int at = block_exclusive_sum(mine, counts, &total);  // (in thread order)
    int kept = total;
    if (kept == 0 || kept > MIN_P_KEPT) {  // (none: a row of NaN or -inf)
        if (threadIdx.x == 0) out[0] = -1;
        return;
    }
    for (int i = lo; i < hi; i++)
        if ((x[i] - m) / T >= floor) ids[at++] = i;
    __syncthreads();
    int last = kept - 1;
    if (top_p < 1.0) {
        last = top_p_cut(x, n, m, T, top_p, ids, kept, cdf, s, rank, red64, &limit);
    } else {
        for (int j = threadIdx.x; j < kept; j += blockDim.x)
            cdf[j] = exp((double)((x[ids[j]] - m) / T));
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    double sum = 0.0;
    for (int j = 0; j < kept; j++) cdf[j] = sum += cdf[j];
    double target = u * sum;
    int a = 0, b = kept;  // the first j with cdf[j] > target (searchsorted, side right)
    while (a < b) {
        int c = (a + b) >> 1;
        if (cdf[c] > target) b = c; else a = c + 1;
    }
    out[0] = x.id(ids[min(a, last)]);
}
