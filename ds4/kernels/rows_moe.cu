// The routed (and shared) experts of a decode batch on tensor cores: each distinct expert
// read once with the tokens that picked it as the mma's columns (the formats and the mma
// loop: rows.cuh).

#include "common.cuh"
#include "rows.cuh"

// MoE of B tokens: the (token, slot) pairs p = b * k + j grouped by expert, each distinct expert
// read once with its tokens as the batch columns. units[0] = number of experts hit; unit u at
// units + 1 + UNIT * u: (expert, count, pairs in increasing order). A token picks an expert at
// most once, so count <= B <= 8. Optional (null: off): on_host[e] != 0 puts the units of experts
// in mapped host memory first (the grids take items in unit order, so their slow
// PCIe reads start in the first wave); *live members only (tokens b >= *live are idle rows of a
// graph: their pairs join no unit, so they read no expert); counts[e] += the live picks of e
// (placement's routing counts: one thread owns each expert, no atomics). Neither the unit order
// nor the idle rows change a live row: a pair's products depend on its own mma column only,
// and rows_moe_sum adds them in slot order. Blocks past the first split x [n, K] (x non-null)
// into the FP4 experts' words xs (rows.cuh's split_rows, a word a thread), beside the grouping
// instead of in a launch of their own after it.
constexpr int UNIT = 10, MAX_PAIRS = 64;

extern "C" __global__ void rows_moe_group(const int* __restrict__ idx, int pairs, int k,
                                          int n_experts, const int* __restrict__ on_host,
                                          const int* __restrict__ live, int* counts,
                                          int* units, const float* __restrict__ x, int n, int K,
                                          long long x_ld, u32* xs, long long xs_ld) {
    wait_inputs();  // (pdl.py)
    if (blockIdx.x > 0) {
        split_rows<Fp4>(x, n, K, x_ld, xs, xs_ld, (blockIdx.x - 1) * (long long)blockDim.x +
                        threadIdx.x);
        return;
    }
    __shared__ int sidx[MAX_PAIRS], wcount[RW], base;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (live) pairs = min(pairs, max(*live, 0) * k);
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) sidx[p] = idx[p];
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    for (int pass = 0; pass < (on_host ? 2 : 1); pass++)  // host experts, then resident ones
        for (int e0 = 0; e0 < n_experts; e0 += blockDim.x) {
            int e = e0 + threadIdx.x, count = 0;
            for (int p = 0; p < pairs; p++) count += sidx[p] == e;
            bool hit = e < n_experts && count > 0 && (!on_host || (on_host[e] != 0) == (pass == 0));
            unsigned int ballot = __ballot_sync(0xffffffffu, hit);
            if (lane == 0) wcount[warp] = __popc(ballot);
            __syncthreads();
            int at = base + __popc(ballot & ((1u << lane) - 1u)), total = 0;
            for (int w = 0; w < RW; w++) {
                at += w < warp ? wcount[w] : 0;
                total += wcount[w];
            }
            if (hit) {
                int* u = units + 1 + UNIT * at;
                u[0] = e;
                int n = 0;
                for (int p = 0; p < pairs && n < 8; p++)
                    if (sidx[p] == e) u[2 + n++] = p;
                u[1] = n;
                if (counts) counts[e] += count;
            }
            __syncthreads();
            if (threadIdx.x == 0) base += total;
            __syncthreads();
        }
    if (threadIdx.x == 0) units[0] = base;
}

// The shared-expert format of kernels without one.
struct NoShared {
    static constexpr bool NONE = true;
};

// A stack of experts (expert e at e * w_stride code bytes, e * s_stride scale bytes), one matrix
// (strides 0), or experts anywhere (wp non-null: expert e's codes at wp[e], its scales at sp[e],
// device or mapped host addresses; a placed stack, whose tables re-placement rewrites between
// graph replays).
struct Bank {
    const u8* w;
    const u8* s;
    const long long* wp;
    const long long* sp;
    long long w_stride, s_stride;
    int sc_ld, shift;
    __device__ const u8* codes(long long e) const {
        return wp ? (const u8*)wp[e] : w + e * w_stride;
    }
    __device__ const u8* scales(long long e) const {
        return sp ? (const u8*)sp[e] : s + e * s_stride;
    }
    // Expert e alone as a one-matrix bank (its addresses resolved once per work item).
    __device__ Bank at(long long e) const {
        return Bank{codes(e), scales(e), nullptr, nullptr, 0, 0, sc_ld, shift};
    }
};

// Work item `item` of a routed part (n_units * passes * tiles items) then a shared part
// (passes * tiles_s): unit (-1 for the shared expert), pass (columns 4 * pass.. over more
// than 4 tokens) and row tile. (tiles_s is 0 only for the kernels without a
// shared expert, rows_moe.py's "_none" ones, whose shared branch compiles away: the shared
// items this then yields do nothing.)
__device__ __forceinline__ bool moe_item(int item, int n_units, int passes, int tiles,
                                         int tiles_s, int& unit, int& pass, int& tile) {
    if (item < n_units * passes * tiles) {
        unit = item / (passes * tiles);
        pass = (item - unit * passes * tiles) / tiles;
        tile = item - (unit * passes + pass) * tiles;
        return true;
    }
    unit = -1;
    item -= n_units * passes * tiles;
    pass = item / max(tiles_s, 1);
    tile = item - pass * tiles_s;
    return pass < passes;
}

// Passes of an MoE kernel over `batch` tokens. The kernels run one mma tile a row tile, hi and
// lo of 4 columns in it (rows.cuh's NT = 1: 128 registers, two blocks an SM), so they take 4
// columns a pass; 5..8 tokens take two (an expert of more than 4 tokens is read once a pass).
// The two-tile NT = 2 layout, one pass over 8 columns, gives the same sums and measured no
// faster at B = 8 in stop 30 (docs/PERF.md).
constexpr int NT = 1;
__device__ __forceinline__ int moe_passes(int batch) { return batch > 4 ? 2 : 1; }

// gate/up of one row group: rows j0.. of gate (tile 0) and of up (tile 1, `up_row` rows
// further), x columns of the unit's tokens (or the batch, for the shared expert) from column
// `first` on (a pass: up to 4 columns); act[out pair] = silu(min(g, limit)) *
// clamp(u, +-limit) * weight. XS: x's split words xs instead.
template <class F, bool XS>
__device__ void gate_up_group(const Bank& bk, const Bank& up, long long e, int up_row, int inter,
                              int cols, const float* x, long long x_ld, const u32* xs,
                              long long xs_ld, const int* unit, int first, int k,
                              const float* wts, float* act, int batch, float limit, int KW,
                              int tile, float* red) {
    int warp = threadIdx.x >> 5, kw = warp % KW, g = first + lane_slot<NT>();
    int j0 = (tile * ((blockDim.x >> 5) / KW) + warp / KW) * 16;  // (blocks of 2, 4 or 8 warps)
    float v[2][4] = {};
    if (j0 < inter) {
        Tiles<2> tl;
        set_tile<F, 2>(tl, 0, bk.codes(e), bk.scales(e), j0, inter, cols, bk.sc_ld, bk.shift);
        set_tile<F, 2>(tl, 1, up.codes(e), up.scales(e), up_row + j0, up_row + inter, cols,
                       up.sc_ld, up.shift);
        int n = unit ? unit[1] : batch, kt0, kt1;
        XSrc src = lane_src<F, NT, XS>(x, x_ld, xs, xs_ld, g < n ? (unit ? unit[2 + g] / k : g)
                                       : -1, 0);
        k_span<F>(cols, kw, KW, kt0, kt1);
        warp_rows<F, 2, 2, NT, XS>(tl, src, kt0, kt1, cols, bk.shift, v);
    }
    reduce_k<2>(v, kw, KW, red);
    if (kw != 0 || j0 >= inter) return;
    int n = unit ? unit[1] : batch;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int j = out_row(j0, i), c = first + out_col(i);
        if (j >= inter || c >= n || out_col(i) >= 4) continue;  // (columns 4..7: lo)
        int p = unit ? unit[2 + c] : c;
        float gs = v[0][i], us = v[1][i];
        if (limit > 0.f) {
            gs = fminf(gs, limit);
            us = fminf(fmaxf(us, -limit), limit);
        }
        act[(size_t)p * inter + j] = gs / (1.f + expf(-gs)) * us * (unit ? wts[p] : 1.f);
    }
}

// down of one row group (32 rows): out[out pair][r] = down_e[r] . act[pair] for the pass's
// columns from `first` (XS: act's split words as).
template <class F, bool XS>
__device__ void down_group(const Bank& bk, long long e, int rows, int inter, const float* act,
                           const u32* as, long long as_ld, const int* unit, int first,
                           float* out, int batch, int KW, int tile, float* red) {
    int warp = threadIdx.x >> 5, kw = warp % KW, g = first + lane_slot<NT>();
    int r0 = (tile * ((blockDim.x >> 5) / KW) + warp / KW) * 32;
    float v[2][4] = {};
    if (r0 < rows) {
        Tiles<2> tl;
        const u8 *W = bk.codes(e), *S = bk.scales(e);
        set_tile<F, 2>(tl, 0, W, S, r0, rows, inter, bk.sc_ld, bk.shift);
        set_tile<F, 2>(tl, 1, W, S, r0 + 16, rows, inter, bk.sc_ld, bk.shift);
        int n = unit ? unit[1] : batch, kt0, kt1;
        XSrc src = lane_src<F, NT, XS>(act, inter, as, as_ld, g < n ? (unit ? unit[2 + g] : g)
                                       : -1, 0);
        k_span<F>(inter, kw, KW, kt0, kt1);
        warp_rows<F, 2, 2, NT, XS>(tl, src, kt0, kt1, inter, bk.shift, v);
    }
    reduce_k<2>(v, kw, KW, red);
    if (kw != 0 || r0 >= rows) return;
    int n = unit ? unit[1] : batch;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = out_row(r0 + 16 * mt, i), c = first + out_col(i);
            if (r < rows && c < n && out_col(i) < 4)
                out[(size_t)(unit ? unit[2 + c] : c) * rows + r] = v[mt][i];
        }
}

#define BANK_ARGS(p) const u8* __restrict__ p##_w, const u8* __restrict__ p##_s, \
    const long long* __restrict__ p##_wp, const long long* __restrict__ p##_sp, \
    long long p##_ws, long long p##_ss, int p##_ld, int p##_shift
#define BANK(p) Bank{p##_w, p##_s, p##_wp, p##_sp, p##_ws, p##_ss, p##_ld, p##_shift}
#define MOE_GATE_UP_ARGS BANK_ARGS(rb), BANK_ARGS(sg), BANK_ARGS(su), \
    const int* __restrict__ units, int routed, int k, const float* __restrict__ wts, \
    const float* __restrict__ x, long long x_ld, float* act, float* sact, int inter, \
    int s_inter, int cols, int batch, float limit, int KW, int tiles, int tiles_s, \
    const u32* __restrict__ xs, long long xs_ld, const u32* __restrict__ ss, long long ss_ld
#define MOE_DOWN_ARGS BANK_ARGS(rb), BANK_ARGS(sd), const int* __restrict__ units, \
    int routed, const float* __restrict__ act, const float* __restrict__ sact, float* part, \
    float* spart, int rows, int inter, int s_inter, int batch, int KW, int tiles, int tiles_s, \
    const u32* __restrict__ as, long long as_ld, const u32* __restrict__ sas, long long sas_ld

// The items of the routed experts hit, then the shared expert's, one block each or (a persistent
// grid) looped over by resident blocks. XS: x split once, routed words xs (format F) and shared
// words ss (format FS). A block of RW warps takes RW / KW row groups an item, one of RW / 2 or
// RW / 4 warps (rows_moe.py's item_warps) fewer: the same rows, k-spans and sums in more items.
template <class F, class FS, bool XS>
__device__ void moe_gate_up(const Bank& rb, const Bank& sg, const Bank& su, const int* units,
                            int routed, int k, const float* wts, const float* x,
                            long long x_ld, float* act, float* sact, int inter, int s_inter,
                            int cols, int batch, float limit, int KW, int tiles, int tiles_s,
                            const u32* xs, long long xs_ld, const u32* ss, long long ss_ld) {
    __shared__ float red[RW * 2 * 4 * 32];
    int n_units = routed ? units[0] : 0, passes = moe_passes(batch), unit, pass, tile;
    for (int item = blockIdx.x; moe_item(item, n_units, passes, tiles, tiles_s, unit, pass, tile);
         item += gridDim.x) {
        int first = 4 * pass;
        if (unit >= 0) {
            const int* u = units + 1 + UNIT * unit;
            if (first >= u[1]) continue;  // (a block-wide skip: every warp takes the same item)
            Bank ex = rb.at(u[0]);
            gate_up_group<F, XS>(ex, ex, 0, inter, inter, cols, x, x_ld, xs, xs_ld, u, first, k,
                                 wts, act, batch, limit, KW, tile, red);
        } else if constexpr (!FS::NONE) {
            gate_up_group<FS, XS>(sg, su, 0, 0, s_inter, cols, x, x_ld, ss, ss_ld, nullptr, first,
                                  k, wts, sact, batch, limit, KW, tile, red);
        }
    }
}

template <class F, class FS, bool XS>
__device__ void moe_down(const Bank& rb, const Bank& sd, const int* units, int routed,
                         const float* act, const float* sact, float* part, float* spart,
                         int rows, int inter, int s_inter, int batch, int KW, int tiles,
                         int tiles_s, const u32* as, long long as_ld, const u32* sas,
                         long long sas_ld) {
    __shared__ float red[RW * 2 * 4 * 32];
    int n_units = routed ? units[0] : 0, passes = moe_passes(batch), unit, pass, tile;
    for (int item = blockIdx.x; moe_item(item, n_units, passes, tiles, tiles_s, unit, pass, tile);
         item += gridDim.x) {
        int first = 4 * pass;
        if (unit >= 0) {
            const int* u = units + 1 + UNIT * unit;
            if (first >= u[1]) continue;  // (block-wide, as in moe_gate_up)
            down_group<F, XS>(rb.at(u[0]), 0, rows, inter, act, as, as_ld, u, first, part, batch,
                              KW, tile, red);
        } else if constexpr (!FS::NONE) {
            down_group<FS, XS>(sd, 0, rows, s_inter, sact, sas, sas_ld, nullptr, first, spart,
                               batch, KW, tile, red);
        }
    }
}

// The kernels (suffix _n1: one mma tile a row tile); the trailing arguments are the launch
// bounds (`32 * RW, 1` where ptxas would otherwise squeeze a kernel that needs more than 128
// registers, one block per SM either way, into 128 and spill).
#define MOE_KERNELS(name, F, FS, XS, ...) \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) \
    rows_gate_up_##name##_n1(MOE_GATE_UP_ARGS) { \
        wait_inputs(); \
        moe_gate_up<F, FS, XS>(BANK(rb), BANK(sg), BANK(su), units, routed, k, wts, x, x_ld, act, \
                               sact, inter, s_inter, cols, batch, limit, KW, tiles, tiles_s, xs, \
                               xs_ld, ss, ss_ld); } \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) \
    rows_down_##name##_n1(MOE_DOWN_ARGS) { \
        wait_inputs(); \
        moe_down<F, FS, XS>(BANK(rb), BANK(sd), units, routed, act, sact, part, spart, rows, \
                            inter, s_inter, batch, KW, tiles, tiles_s, as, as_ld, sas, sas_ld); }
#define MOE(name, F, FS) MOE_KERNELS(name, F, FS, false, 32 * RW)

MOE_KERNELS(fp4_fp8, Fp4, Fp8, false, 32 * RW, 1)
// the decoder's experts reading x and the activations split once (rows_split, rows.cu)
MOE_KERNELS(xs_fp4_fp8, Fp4, Fp8, true, 32 * RW, 2)
// their routed experts alone, where the shared expert runs on a side stream (rows_moe.py's
// shared_ahead: the launches above with routed = 0 take its items)
MOE_KERNELS(xs_fp4_none, Fp4, NoShared, true, 32 * RW, 2)
MOE(fp4_bf16, Fp4, Bf16)
MOE(fp8_fp8, Fp8, Fp8)
MOE(bf16_bf16, Bf16, Bf16)
// routed experts alone (fewer registers, more blocks per SM); the shared expert then runs
// through a launch of the kernels above with routed = 0
MOE(fp4_none, Fp4, NoShared)
MOE(fp8_none, Fp8, NoShared)
MOE(bf16_none, Bf16, NoShared)

// y[b] = sum_j part[b * k + j] in slot order, then + spart[b] (the shared expert), as the
// unbatched kernels add the shared expert onto the routed sum. Idle rows (b >= *live, live
// non-null) joined no unit, so their part rows hold nothing of this call: their routed sum is 0.
// A pick whose idx is negative (an expert another rank holds: expert parallel) joined no unit
// either and adds nothing (0 + a == a, so a sum without such picks is unchanged).
extern "C" __global__ void rows_moe_sum(const float* __restrict__ part,
                                        const float* __restrict__ spart, int k, int rows,
                                        int batch, const int* __restrict__ live,
                                        const int* __restrict__ idx, float* y, long long y_ld) {
    wait_inputs();  // (pdl.py)
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= batch * rows) return;
    int b = t / rows, r = t - b * rows;
    float s = 0.f;
    if (!live || b < *live) {
        const float* p = part + (size_t)b * k * rows + r;
        for (int j = 0; j < k; j++)
            if (idx[b * k + j] >= 0) s += p[(size_t)j * rows];
    }
    if (spart) s = s + spart[(size_t)b * rows + r];
    y[b * y_ld + r] = s;
}

