// Grouped expert GEMMs for prefill on Hopper's warpgroup MMA (wgmma, sm_90a only; the launcher
// takes them on a compute capability 9.0 device and grouped.cu's mma.sync kernels elsewhere).
// Same tile table, weight ring and FP4 decode as grouped.cu (docs/PERF.md): a block's 256
// threads are two warpgroups, each multiplying 256 weight rows (four m64 tiles) by the tile's
// tokens. The decoded weights are wgmma's register operand A (m64 x k16 per instruction, the
// mma.sync A-fragment layout per warp), so the decode stays in registers as before; the
// activations are operand B from shared memory (N = 16 per used m16 tile of tokens, K-major,
// no swizzle: core matrices of 8 rows x 16 bytes, the k-direction ones BM * 16 bytes apart,
// 8-row groups 128 bytes apart). One instruction covers what 4 x USED mma.sync did, so the
// tensor cores wait less on issue, and a k-step's wgmmas run while the next one decodes.
//
// Operand B's k order must match A's permuted one: after the lane's shift-and-mask decode of
// step s = 2 j + h, A's k index kk means column 32 t + 8 j + 2 h + 4 e (kk = 2 t + e) or that
// + 1 (kk = 8 + 2 t + e). split_words_wg writes each row's 16 values of a step in that order.

#include "common.cuh"
#include "grouped.cuh"

typedef unsigned long long u64;

// words [rows, stages * 32] (uint4 pieces) of x [rows, cols] fp32: per 128-column stage, k-step
// s = 2 j + h, part hl (hi, lo) and half q, the step's k values 8 q .. 8 q + 7 as bf16 (kk =
// 2 t + e -> column 32 t + 8 j + 2 h + 4 e; kk = 8 + 2 t + e -> that + 1), at piece
// ((s * 2 + hl) * 2 + q). Columns past cols are zeros; parts == 1: lo words zero.
extern "C" __global__ void split_words_wg(const float* __restrict__ x, long long x_ld, int rows,
                                          int cols, int stages, int parts,
                                          uint4* __restrict__ words) {
    long long n = (long long)rows * stages * 16;  // one thread: (row, stage, step, hl)
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / (stages * 16);
        int q = (int)(i - r * stages * 16), st = q >> 4, s = (q >> 1) & 7, hl = q & 1;
        int j = s >> 1, h = s & 1;
        unsigned short w[16];
#pragma unroll
        for (int kk = 0; kk < 16; kk++) {
            int t = (kk & 7) >> 1, e = kk & 1;
            int c = st * BK + 32 * t + 8 * j + 2 * h + (kk >= 8 ? 1 : 0) + 4 * e;
            float v = c < cols ? x[r * x_ld + c] : 0.f;
            unsigned short hi = round_bf16(v);
            w[kk] = hl == 0 ? hi : (parts == 2 ? round_bf16(v - widen(hi)) : (unsigned short)0);
        }
        uint4* out = words + (r * stages + st) * 32 + (s * 2 + hl) * 2;
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const unsigned short* p = w + 8 * half;
            out[half] = make_uint4(p[0] | ((u32)p[1] << 16), p[2] | ((u32)p[3] << 16),
                                   p[4] | ((u32)p[5] << 16), p[6] | ((u32)p[7] << 16));
        }
    }
}

namespace wg {

constexpr int BM = 64;            // token rows of a tile (smem layout; instructions use 16 * USED)
constexpr int BN = 512;           // weight rows of a block: 2 warpgroups x 4 m64 tiles
constexpr int A_BYTES = 8 * 2 * 2 * BM * 16;   // per stage: 8 steps x hl x 2 core-matrix columns
constexpr int W_BYTES = BN * 64;               // FP4: 64 bytes a row per stage
constexpr int STAGE = A_BYTES + W_BYTES;

__device__ __forceinline__ u64 desc_of(const void* smem) {
    u32 addr = (u32)__cvta_generic_to_shared(smem);
    const u32 lbo = BM * 16, sbo = 128;  // k core matrices BM * 16 bytes apart, 8-row groups 128
    return (u64)((addr >> 4) & 0x3FFF) | ((u64)((lbo >> 4) & 0x3FFF) << 16) |
           ((u64)((sbo >> 4) & 0x3FFF) << 32);
}

// smem row n of the block -> weight row (gate/up: warpgroup g's tiles 0, 1 are gate rows of
// its 128 features, tiles 2, 3 the up rows of the same features).
template <bool GATE_UP>
__device__ __forceinline__ int weight_row(int n, int n0, int half) {
    if (!GATE_UP) return n0 + n;
    int group = n >> 8, tile = (n >> 6) & 3, rr = n & 63;
    int f = n0 + group * 128 + (tile & 1) * 64 + rr;
    return f < half ? f + (tile >= 2 ? half : 0) : -1;
}

// The smem row of this lane's row i (0..7): tile i / 2, row g (+ 8 for odd i) of its warp.
__device__ __forceinline__ int lane_row(int i) {
    int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
    return (warp >> 2) * 256 + (i >> 1) * 64 + (warp & 3) * 16 + g + (i & 1) * 8;
}

// Where a block's stages come from: the tile's activation words and the expert's weight rows.
template <bool GATE_UP>
struct Source {
    const uint4* words;
    long long w_ld;
    const int* a_rows;
    int tile_rows;
    Weights W;
    int expert, n0;

    // Piece m (0..7) of stage st's copies into buf: this thread's m-th activation piece and
    // m-th weight chunk (a stage is 8 pieces a thread, so a k-step can issue one).
    __device__ __forceinline__ void load_piece(u8* buf, int st, int m) const {
        int i = threadIdx.x + 256 * m;
        int r = i >> 5, p = i & 31;  // piece p = (s * 2 + hl) * 2 + q
        bool ok = r < tile_rows;
        // int offsets (a chunk's words and an expert's rows are far below 2^31): long long
        // ones cost gemm_fp4_wg the registers it spilled
        const uint4* src = words + (ok ? a_rows[r] * (int)w_ld : 0) + st * 32 + p;
        copy16(buf + ((p >> 1) * 2 * BM + (p & 1) * BM + r) * 16, src, ok);
        int n = i >> 2, c = i & 3;
        int row = weight_row<GATE_UP>(n, n0, W.rows / (GATE_UP ? 2 : 1));
        int col = st * BK + c * 32;
        bool in = row >= 0 && row < W.rows && col < W.cols;
        const u8* base = W.codes + expert * W.e_stride;
        copy16(buf + A_BYTES + n * 64 + c * 16,
               base + (in ? row * (W.cols / 2) + col / 2 : 0), in);
    }

    __device__ __forceinline__ void load_stage(u8* buf, int st) const {
#pragma unroll 1
        for (int m = 0; m < 8; m++) load_piece(buf, st, m);
    }
};

template <bool GATE_UP>
__device__ __forceinline__ void load_scales(const Weights& W, int expert, int n0, int st,
                                            u32* packed) {
    int t = threadIdx.x & 3;
    const u8* s = W.scale + expert * W.s_stride;
    int half = W.rows / (GATE_UP ? 2 : 1);
    packed[0] = packed[1] = 0u;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int row = weight_row<GATE_UP>(lane_row(i), n0, half);
        int col = st * BK + 32 * t;
        u32 byte = 127u;
        if (row >= 0 && row < W.rows && col < W.cols)
            byte = __ldg(s + (long long)row * W.sc_ld + (col >> 5));
        packed[i >> 2] |= byte << (8 * (i & 3));
    }
}

template <int N>
__device__ __forceinline__ void wgmma(float* d, const u32* a, u64 desc);

#define WG_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
template <>
__device__ __forceinline__ void wgmma<16>(float* d, const u32* a, u64 desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 1, 1, 1, 0;\n"
                 : WG_ACC8(0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma<32>(float* d, const u32* a, u64 desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
                 "{%16,%17,%18,%19}, %20, 1, 1, 1, 0;\n"
                 : WG_ACC8(0), WG_ACC8(8)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma<48>(float* d, const u32* a, u64 desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23}, {%24,%25,%26,%27}, %28, 1, 1, 1, 0;\n"
                 : WG_ACC8(0), WG_ACC8(8), WG_ACC8(16)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma<64>(float* d, const u32* a, u64 desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
                 "{%32,%33,%34,%35}, %36, 1, 1, 1, 0;\n"
                 : WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
#undef WG_ACC8

__device__ __forceinline__ void fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int K>
__device__ __forceinline__ void wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(K) : "memory");
}

// acc[tile][N / 2] += the stage's 8 k-steps (hi, then lo) for N = 16 * USED tokens. Each
// k-step, once its wgmmas are issued, issues a piece of stage `ahead`'s copies into `next`
// (when ahead >= 0), so the copies' address work runs beside the tensor cores.
template <int USED, int PARTS, bool GATE_UP>
__device__ __forceinline__ void stage_wgmma(const u8* buf, const u32* scales,
                                            float (*acc)[8 * USED], const Source<GATE_UP>& src,
                                            u8* next, int ahead) {
    const u8* sw = buf + A_BYTES;
    int t = threadIdx.x & 3;
    u32 q[8][4];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        uint4 v = *(const uint4*)(sw + lane_row(i) * 64 + t * 16);
        q[i][0] = v.x; q[i][1] = v.y; q[i][2] = v.z; q[i][3] = v.w;
    }
    u32 fac[8];
#pragma unroll
    for (int i = 0; i < 8; i++) fac[i] = Fp4::factor((scales[i >> 2] >> (8 * (i & 3))) & 0xffu);
    u32 a[2][4][4];  // two k-steps' A fragments: one decoding while the other multiplies
#pragma unroll
    for (int s = 0; s < 8; s++) {
        const int j = s >> 1, h = s & 1;
        u32(&as)[4][4] = a[s & 1];
#pragma unroll
        for (int tile = 0; tile < 4; tile++) {
            u32 r0b0, r0b1, r1b0, r1b1;  // rows g and g + 8 of the tile
            Fp4::decode(q[2 * tile], j, h, r0b0, r0b1);
            Fp4::decode(q[2 * tile + 1], j, h, r1b0, r1b1);
            as[tile][0] = bf16x2_mul(r0b0, fac[2 * tile]);
            as[tile][1] = bf16x2_mul(r1b0, fac[2 * tile + 1]);
            as[tile][2] = bf16x2_mul(r0b1, fac[2 * tile]);
            as[tile][3] = bf16x2_mul(r1b1, fac[2 * tile + 1]);
        }
        fence();
#pragma unroll
        for (int hl = 0; hl < 2; hl++) {
            if (hl == 1 && PARTS == 1) break;
            u64 desc = desc_of(buf + (s * 2 + hl) * 2 * BM * 16);
#pragma unroll
            for (int tile = 0; tile < 4; tile++) wgmma<16 * USED>(acc[tile], as[tile], desc);
        }
        commit();
        if (ahead >= 0) src.load_piece(next, ahead, s);
        wait<1>();  // the step before this one is done: its A registers may be rewritten
    }
    wait<0>();  // the stage's smem is free for the next load
}

// Accumulator element e of tile `tile`: weight row tile * 64 + 16 warp + g (+ 8), token
// 8 (e / 4) + 2 t + e % 2.
template <int USED, bool GATE_UP>
__device__ __forceinline__ void store(float (*acc)[8 * USED], int row0, int tile_rows, int n0,
                                      int n_out, const int* order, const float* wts,
                                      float limit, float* out, long long out_ld) {
    int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const int tiles = GATE_UP ? 2 : 4;
#pragma unroll
    for (int tile = 0; tile < tiles; tile++) {
#pragma unroll
        for (int e = 0; e < 8 * USED; e++) {
            int tok = 8 * (e >> 2) + 2 * t + (e & 1);
            if (tok >= tile_rows) continue;
            int f = (warp & 3) * 16 + g + ((e & 3) >> 1) * 8 + tile * 64;
            int col = GATE_UP ? n0 + (warp >> 2) * 128 + f : n0 + (warp >> 2) * 256 + f;
            if (col >= n_out) continue;
            int sorted = row0 + tok, pick = order ? order[sorted] : sorted;
            float v = acc[tile][e];
            if (GATE_UP) v = swiglu(v, acc[tile + 2][e], limit) * (wts ? wts[pick] : 1.f);
            out[(long long)(GATE_UP ? sorted : pick) * out_ld + col] = v;
        }
    }
}

template <int USED, bool GATE_UP>
__device__ __forceinline__ void run(const Source<GATE_UP>& src, int parts, int row0,
                                    const int* order, const float* wts, float limit, float* out,
                                    long long out_ld) {
    extern __shared__ __align__(128) u8 smem[];
    float acc[4][8 * USED];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int e = 0; e < 8 * USED; e++) acc[i][e] = 0.f;
    const Weights& W = src.W;
    const int stages = (W.cols + BK - 1) / BK;
    constexpr int STAGES = 3;
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < stages) src.load_stage(smem + s * STAGE, s);
        copy_commit();
    }
    u32 scales[2];
    load_scales<GATE_UP>(W, src.expert, src.n0, 0, scales);
    for (int st = 0; st < stages; st++) {
        copy_wait<STAGES - 2>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async -> wgmma
        __syncthreads();  // also: every warpgroup's wgmmas on the buffer refilled below are done
        int next = st + STAGES - 1;
        u32 ahead[2];
        load_scales<GATE_UP>(W, src.expert, src.n0, min(st + 1, stages - 1), ahead);
        u8* buf = smem + (st % STAGES) * STAGE;
        u8* into = smem + (next % STAGES) * STAGE;
        int fill = next < stages ? next : -1;
        if (parts == 2)  // a branch outside the wgmma sequence: inside, ptxas waits at it
            stage_wgmma<USED, 2>(buf, scales, acc, src, into, fill);
        else
            stage_wgmma<USED, 1>(buf, scales, acc, src, into, fill);
        copy_commit();
        scales[0] = ahead[0];
        scales[1] = ahead[1];
    }
    int n_out = GATE_UP ? W.rows / 2 : W.rows;
    store<USED, GATE_UP>(acc, row0, src.tile_rows, src.n0, n_out, order, wts, limit, out, out_ld);
}

template <bool GATE_UP>
__device__ void grouped(const uint4* __restrict__ words, long long w_ld,
                        const int* __restrict__ order, int k_div, const float* __restrict__ wts,
                        const int4* __restrict__ tiles, const int* __restrict__ n_tiles,
                        Weights W, int parts, float limit, float* __restrict__ out,
                        long long out_ld) {
    __shared__ int a_rows[BM];
    if ((int)blockIdx.y >= *n_tiles) return;
    const int4 tile = tiles[blockIdx.y];
    const int row0 = tile.y, tile_rows = tile.z;
    const int n0 = blockIdx.x * (GATE_UP ? BN / 2 : BN);  // gate/up: 256 features a block
    for (int i = threadIdx.x; i < BM; i += 256) {
        int r = row0 + min(i, tile_rows - 1);
        a_rows[i] = GATE_UP && order ? order[r] / k_div : r;
    }
    __syncthreads();
    const Source<GATE_UP> src{words, w_ld, a_rows, tile_rows, W, tile.x, n0};
#define RUN(U) run<U, GATE_UP>(src, parts, row0, order, wts, limit, out, out_ld)
    switch (tile.w > 0 ? min(tile.w, 4) : 4) {
    case 1: RUN(1); break;
    case 2: RUN(2); break;
    case 3: RUN(3); break;
    default: RUN(4);
    }
#undef RUN
}

}  // namespace wg

#define WG_ARGS const uint4* __restrict__ words, long long w_ld, const int* __restrict__ order, \
    int k_div, const float* __restrict__ wts, const int4* __restrict__ tiles, \
    const int* __restrict__ n_tiles, const u8* codes, const u8* scale, long long e_stride, \
    long long s_stride, int rows, int cols, int sc_ld, int shift, int parts, float limit, \
    float* __restrict__ out, long long out_ld
extern "C" __global__ void __launch_bounds__(256, 1) gate_up_fp4_wg(WG_ARGS) {
    Weights W{codes, scale, e_stride, s_stride, rows, cols, sc_ld, shift};
    wg::grouped<true>(words, w_ld, order, k_div, wts, tiles, n_tiles, W, parts, limit, out, out_ld);
}
extern "C" __global__ void __launch_bounds__(256, 1) gemm_fp4_wg(WG_ARGS) {
    Weights W{codes, scale, e_stride, s_stride, rows, cols, sc_ld, shift};
    wg::grouped<false>(words, w_ld, order, k_div, wts, tiles, n_tiles, W, parts, limit, out,
                       out_ld);
}
