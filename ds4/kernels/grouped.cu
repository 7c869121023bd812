// Grouped expert GEMMs for prefill that read packed weights in place (docs/PERF.md): rows of
// activations grouped by expert (a tile table built on the device); each block multiplies one
// tile of up to 16 * MT rows by a band of one expert's weight rows on tensor cores (mma.sync
// m16n8k16, bf16 in, fp32 accumulation).
//
// Weights: FP4 E2M1 codes (two per byte, low nibble = even column, one E8M0 scale per 32
// columns) or FP8 E4M3 codes (one E8M0 scale per square block of 2^shift). Codes go from global
// to shared memory with cp.async and are decoded in registers by integer bit operations into
// bf16 words that equal value * 2^-126 (E2M1: sign to bit 15, the three exponent/mantissa bits
// to bits 8..6, the subnormal 0.5 included) or value * 2^-120 (E4M3: sign to bit 15, the seven
// other bits to bits 10..4). The power of two is folded into the block's scale, applied with one
// bf16x2 multiply (exact: every product has at most four significant bits and stays normal for
// checkpoint scales; the launchers check the scale bytes stay in range).
//
// Activations: fp32 rows enter as two bf16 words each (hi = round(x), lo = round(x - hi)) so the
// products keep fp32-class accuracy (~1e-5), like the cuBLAS path (ds4/kernels/split.cu); both
// halves meet the same decoded weights and add into one accumulator. split_words writes them in
// the order the fragments want (below), so the GEMMs copy them with 16-byte cp.async.
//
// The k order inside a 128-column stage is permuted, the same way for weights and activations:
// lane (g = lane / 4, t = lane % 4) owns columns 32 t .. 32 t + 31 of the stage (one FP4 scale
// group, one 16-byte FP4 load), and k-step s = 2 j + h of the stage takes, from columns
// c = 32 t + 8 j, the pairs (c + 2h, c + 2h + 4) and (c + 2h + 1, c + 2h + 5) as the fragment's
// two k pairs. That is what the shift-and-mask decode of eight nibbles of one 32-bit word yields.

#include "common.cuh"
#include "grouped.cuh"

constexpr int WARPS = 8;
constexpr int UNITS = 64;  // 8-byte units of one row's words per stage (128 columns x hi, lo)

// Unit u of a row's stage holds columns c + P[h] (c = 32 t + 8 j, P[0] = 0 4 1 5, P[1] = 2 6 3
// 7), hi words (hl = 0) or lo words (hl = 1): u = ((j * 2 + h) * 2 + hl) * 4 + t.
__device__ __forceinline__ int unit_of(int j, int h, int hl, int t) {
    return ((j * 2 + h) * 2 + hl) * 4 + t;
}

// words [rows, stages * UNITS] (uint2) of x [rows, cols] fp32 (row stride x_ld); columns past
// cols are zeros, so a stage may run past a matrix's last column. parts == 1: lo words zero.
extern "C" __global__ void split_words(const float* __restrict__ x, long long x_ld, int rows,
                                       int cols, int stages, int parts, uint2* __restrict__ words) {
    long long n = (long long)rows * stages * 16;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / (stages * 16);
        int q = (int)(i - r * stages * 16), st = q >> 4, t = (q >> 2) & 3, j = q & 3;
        int c = st * BK + 32 * t + 8 * j;
        float v[8];
        if (c < cols) {
            const float4* src = (const float4*)(x + r * x_ld + c);
            float4 a = src[0], b = src[1];
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
            v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = 0.f;
        }
        unsigned short hi[8], lo[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            hi[e] = round_bf16(v[e]);
            lo[e] = parts == 2 ? round_bf16(v[e] - widen(hi[e])) : (unsigned short)0;
        }
        uint2* row = words + r * stages * UNITS + st * UNITS;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int a = 2 * h, b = 2 * h + 1;  // columns (a, a + 4) and (b, b + 4)
            row[unit_of(j, h, 0, t)] = make_uint2(hi[a] | ((u32)hi[a + 4] << 16),
                                                  hi[b] | ((u32)hi[b + 4] << 16));
            row[unit_of(j, h, 1, t)] = make_uint2(lo[a] | ((u32)lo[a + 4] << 16),
                                                  lo[b] | ((u32)lo[b + 4] << 16));
        }
    }
}

// The tile table of rows grouped by expert: offsets from counts[e] (rows of expert e, in expert
// order), one entry (expert, first row, rows, m16 tiles the rows fill) per tile of up to bm rows;
// *n_tiles = entries. A block multiplies only the m16 tiles its rows fill: an expert's last,
// partial tile (and every tile under skewed routing) does less tensor work, not bm rows' worth.
// One thread: ~E + tiles steps, a few microseconds, and no host round trip.
extern "C" __global__ void expert_tiles(const long long* __restrict__ counts, int experts, int bm,
                                        int4* __restrict__ tiles, int* __restrict__ n_tiles) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int row = 0, n = 0;
    for (int e = 0; e < experts; e++) {
        int c = (int)counts[e];
        for (int r = 0; r < c; r += bm) {
            int rows = min(bm, c - r);
            tiles[n++] = make_int4(e, row + r, rows, (rows + 15) / 16);
        }
        row += c;
    }
    *n_tiles = n;
}

// out[t, :] = sum over s < k, in order, of rows[t * k + s, :] (the routed experts' rows back in
// token order; no atomics, so every run gives the same bits).
extern "C" __global__ void slot_sum(const float* __restrict__ rows, int tokens, int k, int cols,
                                    float* __restrict__ out) {
    long long n = (long long)tokens * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = i / cols;
        int c = (int)(i - t * cols);
        const float* r = rows + t * k * cols + c;
        float v = r[0];
        for (int s = 1; s < k; s++) v += r[(long long)s * cols];
        out[i] = v;
    }
}

__device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// smem row n of the block -> the weight row it holds (or -1 past the matrix). Gate/up blocks
// hold BN/2 gate rows then the same BN/2 up rows (up = gate + half rows).
template <bool GATE_UP>
__device__ __forceinline__ int weight_row(int n, int bn, int n0, int half) {
    if (!GATE_UP) return n0 + n;
    int i = n0 + (n % (bn / 2));
    return i < half ? i + (n >= bn / 2 ? half : 0) : -1;
}

// smem row of warp w's n8 tile i (row g of it). Gate/up: tiles i < NT/2 are gate rows, tile
// i + NT/2 the up rows of the same columns, so the epilogue pairs them in registers.
template <class F>
__device__ __forceinline__ int tile_row(int w, int i, int g, bool gate_up) {
    if (!gate_up) return (w * F::NT + i) * 8 + g;
    const int h = F::NT / 2;
    return (i < h ? 0 : WARPS * h * 8) + (w * h + i % h) * 8 + g;
}

template <class F, int MT>
struct Smem {
    static constexpr int BM = 16 * MT;
    static constexpr int BN = WARPS * F::NT * 8;
    static constexpr int A_BYTES = BM * UNITS * 8;
    static constexpr int W_BYTES = BN * F::ROW_BYTES;
    static constexpr int STAGE = A_BYTES + W_BYTES;
};

// Issue the copies of stage st: the tile's activation words (rows a_row(r), zeros past the tile)
// and the block's weight rows (zeros past the matrix or its columns).
template <class F, int MT, bool GATE_UP>
__device__ __forceinline__ void load_stage(u8* buf, const uint2* words, long long w_ld,
                                           const int* a_rows, int tile_rows, const Weights& W,
                                           int expert, int n0, int st) {
    using L = Smem<F, MT>;
    uint2* sa = (uint2*)buf;
    for (int i = threadIdx.x; i < L::BM * 32; i += WARPS * 32) {
        int r = i >> 5, p = i & 31, blk = p >> 1, tp = p & 1;  // 16-byte piece p = (blk, tp)
        bool ok = r < tile_rows;
        const uint2* src = words + (ok ? a_rows[r] : 0) * w_ld + st * UNITS + blk * 4 + tp * 2;
        copy16(sa + (blk * L::BM + r) * 4 + tp * 2, src, ok);
    }
    u8* sw = buf + L::A_BYTES;
    const int chunks = F::ROW_BYTES / 16;
    const u8* base = W.codes + expert * W.e_stride;
    long long row_bytes = F::ROW_BYTES == 64 ? W.cols / 2 : W.cols;
    for (int i = threadIdx.x; i < L::BN * chunks; i += WARPS * 32) {
        int n = i / chunks, c = i % chunks;
        int row = weight_row<GATE_UP>(n, L::BN, n0, W.rows / (GATE_UP ? 2 : 1));
        int col = st * BK + c * F::chunk_cols();
        bool ok = row >= 0 && row < W.rows && col < W.cols;
        const u8* src = base + (ok ? row * row_bytes + col / (F::ROW_BYTES == 64 ? 2 : 1) : 0);
        copy16(sw + F::chunk_at(n, c), src, ok);
    }
}

// The E8M0 bytes of this lane's rows for stage st, four to a word (loaded a stage ahead: two
// registers, not eight): one per n8 tile (FP8: two, one per 16-byte chunk). Columns past the
// matrix get a harmless 127 (their codes are zeros).
template <class F, int MT, bool GATE_UP>
__device__ __forceinline__ void load_scales(const Weights& W, int expert, int n0, int st,
                                            u32* packed) {
    static_assert(F::NT * (F::WORDS / 4) <= 8, "at most eight scale bytes per lane and stage");
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const u8* s = W.scale + expert * W.s_stride;
    int half = W.rows / (GATE_UP ? 2 : 1);
    packed[0] = packed[1] = 0u;
#pragma unroll
    for (int i = 0; i < F::NT; i++) {
        int row = weight_row<GATE_UP>(tile_row<F>(warp, i, g, GATE_UP), Smem<F, MT>::BN, n0, half);
#pragma unroll
        for (int c = 0; c < F::WORDS / 4; c++) {
            int col = st * BK + 32 * t + 16 * c;
            u32 byte = 127u;
            if (row >= 0 && row < W.rows && col < W.cols) {
                byte = F::WORDS == 4 ? __ldg(s + (long long)row * W.sc_ld + (col >> 5))
                                     : __ldg(s + (long long)(row >> W.shift) * W.sc_ld
                                             + (col >> W.shift));
            }
            int e = i * (F::WORDS / 4) + c;
            packed[e >> 2] |= byte << (8 * (e & 3));
        }
    }
}

// acc += the stage in buf times the lane's decoded weights, 8 k-steps, for the first USED
// m16 tiles (the rest hold no rows of this tile).
template <class F, int MT, int USED, bool GATE_UP>
__device__ __forceinline__ void stage_mma(const u8* buf, const u32* scales, int parts,
                                          float (*acc)[F::NT][4]) {
    using L = Smem<F, MT>;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const uint2* sa = (const uint2*)buf;
    const u8* sw = buf + L::A_BYTES;
    u32 q[F::NT][F::WORDS];
#pragma unroll
    for (int i = 0; i < F::NT; i++) {
        int n = tile_row<F>(warp, i, g, GATE_UP);
#pragma unroll
        for (int c = 0; c < F::WORDS / 4; c++) {
            uint4 v = *(const uint4*)(sw + F::chunk_at(n, (F::WORDS / 4) * t + c));
            q[i][4 * c] = v.x; q[i][4 * c + 1] = v.y; q[i][4 * c + 2] = v.z; q[i][4 * c + 3] = v.w;
        }
    }
    constexpr int FACTORS = F::NT * (F::WORDS / 4);
    u32 fac[FACTORS];
#pragma unroll
    for (int e = 0; e < FACTORS; e++) fac[e] = F::factor((scales[e >> 2] >> (8 * (e & 3))) & 0xffu);
#pragma unroll
    for (int s = 0; s < 8; s++) {
        const int j = s >> 1, h = s & 1;
        u32 b[F::NT][2];
#pragma unroll
        for (int i = 0; i < F::NT; i++) {
            F::decode(q[i], j, h, b[i][0], b[i][1]);
            u32 f = fac[i * (F::WORDS / 4) + (F::WORDS == 8 ? j >> 1 : 0)];
            b[i][0] = bf16x2_mul(b[i][0], f);
            b[i][1] = bf16x2_mul(b[i][1], f);
        }
        // hi rows, then lo rows: the two mmas into one accumulator sit NT * MT mmas apart
#pragma unroll
        for (int hl = 0; hl < 2; hl++) {
            if (hl == 1 && parts == 1) break;
            u32 a[MT][4];
#pragma unroll
            for (int m = 0; m < USED; m++) {
                const uint2* u = sa + ((unit_of(j, h, hl, 0) >> 2) * L::BM + m * 16 + g) * 4 + t;
                uint2 top = u[0], low = u[8 * 4];
                a[m][0] = top.x; a[m][1] = low.x; a[m][2] = top.y; a[m][3] = low.y;
            }
#pragma unroll
            for (int i = 0; i < F::NT; i++)
#pragma unroll
                for (int m = 0; m < USED; m++) mma(acc[m][i], a[m], b[i][0], b[i][1]);
        }
    }
}

// Gate/up: act[r, col] = swiglu(gate, up) * wts[order[r]] at the tile's sorted rows r.
// Plain: out[order[r], col] (order null: r) = the product (down's scatter to (token, pick) rows).
template <class F, int MT, bool GATE_UP>
__device__ __forceinline__ void store_tile(float (*acc)[F::NT][4], int row0, int tile_rows,
                                           int n0, int n_out, const int* order, const float* wts,
                                           float limit, float* out, long long out_ld) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int tiles = GATE_UP ? F::NT / 2 : F::NT;
#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            int r = m * 16 + g + 8 * rr;
            if (r >= tile_rows) continue;
            int sorted = row0 + r, pick = order ? order[sorted] : sorted;
            float w = wts ? wts[pick] : 1.f;
            float* y = out + (long long)(GATE_UP ? sorted : pick) * out_ld;
#pragma unroll
            for (int i = 0; i < tiles; i++) {
                int col = n0 + (warp * tiles + i) * 8 + 2 * t;
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    if (col + e >= n_out) continue;
                    float v = acc[m][i][2 * rr + e];
                    if (GATE_UP) v = swiglu(v, acc[m][i + tiles][2 * rr + e], limit) * w;
                    y[col + e] = v;
                }
            }
        }
    }
}

// The k loop of one block: stages through a ring of STAGES buffers, acc += every stage's
// product for the first USED m16 tiles.
template <class F, int MT, int USED, bool GATE_UP, int STAGES>
__device__ __forceinline__ void run_stages(const uint2* words, long long w_ld, const int* a_rows,
                                           int tile_rows, const Weights& W, int expert, int n0,
                                           int parts, float (*acc)[F::NT][4]) {
    using L = Smem<F, MT>;
    extern __shared__ __align__(16) u8 smem[];
    const int stages = (W.cols + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < stages)
            load_stage<F, MT, GATE_UP>(smem + s * L::STAGE, words, w_ld, a_rows, tile_rows, W,
                                       expert, n0, s);
        copy_commit();
    }
    u32 scales[2];
    load_scales<F, MT, GATE_UP>(W, expert, n0, 0, scales);
    for (int st = 0; st < stages; st++) {
        copy_wait<STAGES - 2>();
        __syncthreads();
        int next = st + STAGES - 1;
        if (next < stages)
            load_stage<F, MT, GATE_UP>(smem + (next % STAGES) * L::STAGE, words, w_ld, a_rows,
                                       tile_rows, W, expert, n0, next);
        copy_commit();
        u32 ahead[2];
        load_scales<F, MT, GATE_UP>(W, expert, n0, min(st + 1, stages - 1), ahead);
        stage_mma<F, MT, USED, GATE_UP>(smem + (st % STAGES) * L::STAGE, scales, parts, acc);
        scales[0] = ahead[0];
        scales[1] = ahead[1];
    }
}

// One block: tile blockIdx.y of the table (rows grouped by expert) times weight band
// blockIdx.x (gate/up: BN/2 columns of act; plain: BN output columns). The activation row of
// sorted row r is order[r] / k_div for gate/up (order null: r), r for plain (act rows).
template <class F, int MT, bool GATE_UP, int STAGES>
__device__ void grouped_gemm(const uint2* __restrict__ words, long long w_ld,
                             const int* __restrict__ order, int k_div,
                             const float* __restrict__ wts, const int4* __restrict__ tiles,
                             const int* __restrict__ n_tiles, Weights W, int parts, float limit,
                             float* __restrict__ out, long long out_ld) {
    using L = Smem<F, MT>;
    __shared__ int a_rows[L::BM];
    if ((int)blockIdx.y >= *n_tiles) return;
    const int4 tile = tiles[blockIdx.y];
    const int expert = tile.x, row0 = tile.y, tile_rows = tile.z;
    const int n0 = blockIdx.x * (GATE_UP ? L::BN / 2 : L::BN);
    for (int i = threadIdx.x; i < L::BM; i += WARPS * 32) {
        int r = row0 + min(i, tile_rows - 1);
        a_rows[i] = GATE_UP && order ? order[r] / k_div : r;
    }
    __syncthreads();
    float acc[MT][F::NT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int i = 0; i < F::NT; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[m][i][e] = 0.f;
    // the m16 tiles this tile's rows fill, as a compile-time bound of the mma loops (a
    // run-time bound inside them measured 1.3x slower on full tiles)
    switch (tile.w > 0 ? min(tile.w, MT) : MT) {
#define RUN(USED) run_stages<F, MT, USED, GATE_UP, STAGES>(words, w_ld, a_rows, tile_rows, W, \
                                                          expert, n0, parts, acc)
    case 1: RUN(1); break;
    case 2: if constexpr (MT >= 2) RUN(2); break;
    case 3: if constexpr (MT >= 3) RUN(3); break;
    default: RUN(MT);
#undef RUN
    }
    int n_out = GATE_UP ? W.rows / 2 : W.rows;
    store_tile<F, MT, GATE_UP>(acc, row0, tile_rows, n0, n_out, order, wts, limit, out, out_ld);
}

#define GROUPED_ARGS const uint2* __restrict__ words, long long w_ld, \
    const int* __restrict__ order, int k_div, const float* __restrict__ wts, \
    const int4* __restrict__ tiles, const int* __restrict__ n_tiles, const u8* codes, \
    const u8* scale, long long e_stride, long long s_stride, int rows, int cols, int sc_ld, \
    int shift, int parts, float limit, float* __restrict__ out, long long out_ld
#define GROUPED(name, F, MT, GATE_UP, STAGES, MIN_BLOCKS) \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) name(GROUPED_ARGS) { \
        Weights W{codes, scale, e_stride, s_stride, rows, cols, sc_ld, shift}; \
        grouped_gemm<F, MT, GATE_UP, STAGES>(words, w_ld, order, k_div, wts, tiles, n_tiles, W, \
                                             parts, limit, out, out_ld); \
    }

GROUPED(gate_up_fp4_m1, Fp4, 1, true, 3, 1)
GROUPED(gate_up_fp4_m2, Fp4, 2, true, 3, 1)
GROUPED(gate_up_fp4_m3, Fp4, 3, true, 3, 1)
GROUPED(gate_up_fp4_m4, Fp4, 4, true, 3, 1)
GROUPED(gemm_fp4_m1, Fp4, 1, false, 3, 1)
GROUPED(gemm_fp4_m2, Fp4, 2, false, 3, 1)
GROUPED(gemm_fp4_m3, Fp4, 3, false, 3, 1)
GROUPED(gemm_fp4_m4, Fp4, 4, false, 3, 1)
GROUPED(gate_up_fp8_m1, Fp8, 1, true, 3, 1)
GROUPED(gate_up_fp8_m2, Fp8, 2, true, 3, 1)
GROUPED(gate_up_fp8_m3, Fp8, 3, true, 3, 1)
GROUPED(gate_up_fp8_m4, Fp8, 4, true, 3, 1)
GROUPED(gemm_fp8_m1, Fp8, 1, false, 3, 1)
GROUPED(gemm_fp8_m2, Fp8, 2, false, 3, 1)
GROUPED(gemm_fp8_m3, Fp8, 3, false, 3, 1)
GROUPED(gemm_fp8_m4, Fp8, 4, false, 3, 1)
// Deeper pipelines for one-tile blocks (bound by the weights' bytes; benchmarked against 3)
GROUPED(gate_up_fp4_m1_s4, Fp4, 1, true, 4, 1)
GROUPED(gemm_fp4_m1_s4, Fp4, 1, false, 4, 1)
GROUPED(gate_up_fp4_m2_s4, Fp4, 2, true, 4, 1)
GROUPED(gemm_fp4_m2_s4, Fp4, 2, false, 4, 1)
