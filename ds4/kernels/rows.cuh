// The core of the batched decode products on tensor cores (ds4/kernels/rows.cu's
// matrices, ds4/kernels/rows_moe.cu's experts): the warp's tiles and stages, the mma loop and
// the fixed k-split (the weight formats and their mma words: rows_formats.cuh).
//
// Batched decode products: y[b] = W x[b] for b < B <= 8, each weight byte read
// once for the whole batch (docs/PERF.md). W is FP8 E4M3 (one E8M0 scale per 2^shift square
// tile), MXFP4 E2M1 (two codes a byte, low nibble first, one E8M0 scale per 32 columns) or bf16
// words; x and y are fp32.
//
// Fragment layout (lane = 4 * g + t): A a[0] = row g, k 2t..2t+1; a[1] = row g + 8, same k;
// a[2] = row g, k 2t+8..2t+9; a[3] = row g + 8; B b0 = k 2t..2t+1, b1 = k 2t+8..2t+9 of column
// g; D d[0..1] = row g, columns 2t, 2t+1, d[2..3] = row g + 8. A dot product does not care
// which k slot holds which column, so lane t feeds its own 16-byte chunk of codes (columns
// [k-tile + t * CH, + CH)) and the matching x (F::xcol says which column sits in which slot).
//
// x may also come split once per launch (rows_split, rows.cu): the B words of every lane and
// k-tile laid out as the mma reads them, so each warp loads them instead of loading, scaling
// and splitting its x chunk again for every 16-row tile (the same words: the same sums).
// Layout of format F for one row of x: words [part][k-tile][lane t][mma m][register r], part
// 0 = hi, 1 = lo, each part KT * 2 * CH words (KT k-tiles of 4 * CH columns, zero past K).
//
// Row independence: a block's warps split k into fixed spans by shape only, and their partial
// sums (hi + lo per warp) are added in warp order; an mma column depends on its own B column
// only. So y[b] is bitwise the same for any B and any other rows of the batch.
#pragma once

#include "rows_formats.cuh"

// The rows one warp multiplies: MT tiles of 16 rows, for each its rows g and g + 8 (byte
// pointers of the row start and of its scale row).
template <int MT>
struct Tiles {
    const u8* w[MT][2];
    const u8* s[MT][2];
};

template <class F, int MT>
__device__ __forceinline__ void set_tile(Tiles<MT>& tl, int mt, const u8* W, const u8* S,
                                         int row0, int rows, long long cols, int sc_ld,
                                         int shift) {
    int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int r = min(row0 + g + 8 * h, rows - 1);
        tl.w[mt][h] = W + (size_t)r * F::bytes(cols);
        tl.s[mt][h] = F::SCALED ? F::scale_row(S, r, sc_ld, shift) : nullptr;
    }
}

// DEPTH k-tiles of codes for all MT tiles, loaded together (the bytes in flight per lane).
template <class F, int MT, int DEPTH>
struct Stage {
    uint4 q[DEPTH][MT][2][F::LOADS];
    u32 mul[DEPTH][MT][2];
};

template <class F, int MT, int DEPTH>
__device__ __forceinline__ void load_stage(Stage<F, MT, DEPTH>& st, const Tiles<MT>& tl,
                                           int kt, int kt1, int cols, int shift) {
    int t = threadIdx.x & 3;
#pragma unroll
    for (int d = 0; d < DEPTH; d++) {
        int col = (kt + d) * 4 * F::CH + t * F::CH;
        bool ok = kt + d < kt1 && col < cols;
        // POST: every lane scales its outputs by the k-tile's scale, also a lane whose own
        // chunk lies past the last column
        int s_col = F::POST ? (kt + d) * 4 * F::CH : col;
        bool s_ok = F::SCALED && (F::POST ? kt + d < kt1 : ok);
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint4* p = (const uint4*)(tl.w[mt][h] + F::bytes(col));
#pragma unroll
                for (int l = 0; l < F::LOADS; l++)
                    st.q[d][mt][h][l] = ok ? __ldcs(p + l) : make_uint4(0, 0, 0, 0);
                st.mul[d][mt][h] = s_ok && (h == 0 || !F::POST)
                                       ? F::mul(tl.s[mt][h], s_col, shift) : 0u;
            }
    }
}

// The lane's CH floats of its x column at chunk column col, times 2^32 for scaled formats
// (zeros outside the matrix or for a lane without a column).
template <class F>
__device__ __forceinline__ void load_x(const float* xc, int col, int cols, float* xr) {
    bool ok = xc != nullptr && col < cols;
    const float4* v = (const float4*)(xc + (ok ? col : 0));
    const float k = F::SCALED && !F::POST ? X_SCALE : 1.f;
#pragma unroll
    for (int i = 0; i < F::CH / 4; i++) {
        float4 f = ok ? __ldg(v + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        xr[4 * i] = f.x * k; xr[4 * i + 1] = f.y * k; xr[4 * i + 2] = f.z * k;
        xr[4 * i + 3] = f.w * k;
    }
}

// Where a lane's B words come from (XS): X_REGS its x column (x, split here for every k-tile),
// X_WORDS the words rows_split wrote (w: the lane's own words of k-tile 0 in its part; lo: from
// hi to lo words, for NT = 2), X_SHARED the words stage_x wrote in shared memory (w and lo as
// X_WORDS; un0 / un1: for POST formats, the k-tiles' power inverses of the lane's output
// columns 2t and 2t + 1). Null: a lane without a column (zeros).
enum XFrom { X_REGS = 0, X_WORDS = 1, X_SHARED = 2 };
struct XSrc {
    const float* x;
    const u32* w;
    long long lo;
    const float* un0 = nullptr;
    const float* un1 = nullptr;
};

// Split x words per lane and k-tile of format F (two per mma).
template <class F>
__device__ constexpr int words_per_lane() { return 2 * F::MMAS; }

// Words from one k-tile of a lane's split x to the next: rows_split's rows hold every k-tile's
// hi words, then every k-tile's lo words; stage_x's hold a k-tile's hi, then its lo words.
template <class F, int XS>
__device__ constexpr int kt_words() { return (XS == X_SHARED ? 8 : 4) * words_per_lane<F>(); }

// The lane's B words of k-tile kt from split x: b[m][n] = (register 0, register 1) of mma m
// for tile n (NT = 1: hi for lanes g < 4, lo for the others, by the lane's pointer; NT = 2:
// n = 0 hi, 1 lo).
template <class F, int NT, int XS>
__device__ __forceinline__ void split_words(const XSrc& src, int kt, u32 (&b)[F::MMAS][NT][2]) {
    constexpr int W = words_per_lane<F>();
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < W / 4; i++) {
            uint4 q = make_uint4(0, 0, 0, 0);
            const uint4* p = (const uint4*)(src.w + n * src.lo + (size_t)kt * kt_words<F, XS>());
            if (src.w) q = XS == X_SHARED ? p[i] : __ldg(p + i);
            b[2 * i][n][0] = q.x;
            b[2 * i][n][1] = q.y;
            b[2 * i + 1][n][0] = q.z;
            b[2 * i + 1][n][1] = q.w;
        }
}

// acc[mt] += A (the stage's tiles of mma m of k-tile d) times B words b0, b1 (tile n).
template <class F, int MT, int DEPTH, int NT>
__device__ __forceinline__ void mma_tiles(const Stage<F, MT, DEPTH>& st, int d, int m, int n,
                                          u32 b0, u32 b1, float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        u32 a[4];
        F::decode(st.q[d][mt][0], m, st.mul[d][mt][0], a[0], a[2]);
        F::decode(st.q[d][mt][1], m, st.mul[d][mt][1], a[1], a[3]);
        mma_bf16(acc[mt][n], a, b0, b1);
    }
}

// part[mt][n] += stage slot d's tiles times B words hi, lo (f16, POST formats): NT = 1 lanes
// g < 4 feed hi, the others lo; NT = 2 a hi and a lo mma.
template <class F, int MT, int DEPTH, int NT>
__device__ __forceinline__ void post_mmas(const Stage<F, MT, DEPTH>& st, int d,
                                          const u32 (&hi)[F::MMAS][2], const u32 (&lo)[F::MMAS][2],
                                          float (&part)[MT][NT][4]) {
    int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int m = 0; m < F::MMAS; m++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            u32 a[4];
            F::decode(st.q[d][mt][0], m, 0u, a[0], a[2]);
            F::decode(st.q[d][mt][1], m, 0u, a[1], a[3]);
            if constexpr (NT == 1) {
                mma_f16(part[mt][0], a, g < 4 ? hi[m][0] : lo[m][0], g < 4 ? hi[m][1] : lo[m][1]);
            } else {
                mma_f16(part[mt][0], a, hi[m][0], hi[m][1]);
                mma_f16(part[mt][1], a, lo[m][0], lo[m][1]);
            }
        }
}

// mma_stage of a POST format: each k-tile's mmas sum into fresh fp32 tiles, which are added to
// acc times the tile's scale and the column's x power (output columns 2t and 2t + 1 are fed by
// lanes 8t and 8t + 4: g = the column). The same NT layouts as mma_stage. X_REGS: the lane
// splits its x chunk here (split_f16); X_SHARED: stage_x's words and powers.
template <class F, int MT, int DEPTH, int NT, int XS>
__device__ __forceinline__ void post_stage(const Stage<F, MT, DEPTH>& st, const XSrc& src,
                                           int kt, int kt1, int cols, float (&acc)[MT][NT][4]) {
    static_assert(XS != X_WORDS, "POST formats take x in registers or in shared memory");
    int t = threadIdx.x & 3;
#pragma unroll
    for (int d = 0; d < DEPTH; d++) {
        if (kt + d >= kt1) break;
        float part[MT][NT][4] = {}, u0, u1;
        if constexpr (XS == X_SHARED) {
            u32 b[F::MMAS][NT][2];
            split_words<F, NT, X_SHARED>(src, kt + d, b);
            u32 hi[F::MMAS][2], lo[F::MMAS][2];  // (NT = 1: the lane's own part in both)
#pragma unroll
            for (int m = 0; m < F::MMAS; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    hi[m][r] = b[m][0][r];
                    lo[m][r] = b[m][NT - 1][r];
                }
            post_mmas<F, MT, DEPTH, NT>(st, d, hi, lo, part);
            u0 = src.un0[kt + d];
            u1 = src.un1[kt + d];
        } else {
            float xr[F::CH], un;
            load_x<F>(src.x, (kt + d) * 4 * F::CH + t * F::CH, cols, xr);
            u32 hi[F::MMAS][2], lo[F::MMAS][2];
            split_f16<F>(xr, hi, lo, un);
            post_mmas<F, MT, DEPTH, NT>(st, d, hi, lo, part);
            u0 = __shfl_sync(0xffffffffu, un, 8 * t);
            u1 = __shfl_sync(0xffffffffu, un, 8 * t + 4);
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            float s = __uint_as_float(st.mul[d][mt][0]), f0 = s * u0, f1 = s * u1;
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    acc[mt][n][i] = fmaf(i & 1 ? f1 : f0, part[mt][n][i], acc[mt][n][i]);
        }
    }
}

// acc[mt][n] += the stage's k-tiles: NT = 1 puts hi in columns 0..3 and lo in 4..7 of one
// tile (lanes g >= 4 feed lo), NT = 2 runs a hi and a lo mma. XS (XFrom): B words from split
// x; else the lane's x chunk loaded and split here, one mma's words at a time.
template <class F, int MT, int DEPTH, int NT, int XS>
__device__ __forceinline__ void mma_stage(const Stage<F, MT, DEPTH>& st, const XSrc& src,
                                          int kt, int kt1, int cols, float (&acc)[MT][NT][4]) {
    if constexpr (F::POST) {
        post_stage<F, MT, DEPTH, NT, XS>(st, src, kt, kt1, cols, acc);
        return;
    }
    int t = threadIdx.x & 3, g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int d = 0; d < DEPTH; d++) {
        if (kt + d >= kt1) break;
        if constexpr (XS) {
            u32 b[F::MMAS][NT][2];
            split_words<F, NT, XS>(src, kt + d, b);
#pragma unroll
            for (int m = 0; m < F::MMAS; m++)
#pragma unroll
                for (int n = 0; n < NT; n++)
                    mma_tiles<F, MT, DEPTH, NT>(st, d, m, n, b[m][n][0], b[m][n][1], acc);
        } else {
            float xr[F::CH];
            load_x<F>(src.x, (kt + d) * 4 * F::CH + t * F::CH, cols, xr);
#pragma unroll
            for (int m = 0; m < F::MMAS; m++) {
                u32 hi0, lo0, hi1, lo1;
                split_pair(xr[F::xcol(m, 0, 0)], xr[F::xcol(m, 0, 1)], hi0, lo0);
                split_pair(xr[F::xcol(m, 1, 0)], xr[F::xcol(m, 1, 1)], hi1, lo1);
                if constexpr (NT == 1) {
                    mma_tiles<F, MT, DEPTH, NT>(st, d, m, 0, g < 4 ? hi0 : lo0,
                                                g < 4 ? hi1 : lo1, acc);
                } else {
                    mma_tiles<F, MT, DEPTH, NT>(st, d, m, 0, hi0, hi1, acc);
                    mma_tiles<F, MT, DEPTH, NT>(st, d, m, NT - 1, lo0, lo1, acc);
                }
            }
        }
    }
}

// v[mt][i] = this warp's sum over k-tiles [kt0, kt1) of its tiles for the lane's outputs
// (i: row g col 2t, row g col 2t + 1, row g + 8 col 2t, row g + 8 col 2t + 1; column = slot
// of the batch), hi + lo already added. src: the lane's B column (XSrc). ready() runs once the
// kernel ahead is done, before x is read (matvec's stage_x).
struct Ready {
    __device__ void operator()() const {}
};
template <class F, int MT, int DEPTH, int NT, int XS, class R = Ready>
__device__ __forceinline__ void warp_rows(const Tiles<MT>& tl, const XSrc& src, int kt0, int kt1,
                                          int cols, int shift, float (&v)[MT][4],
                                          const R& ready = R()) {
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mt][n][i] = 0.f;
    Stage<F, MT, DEPTH> cur, nxt;
    load_stage(cur, tl, kt0, kt1, cols, shift);
    wait_inputs();  // the first weights are on their way before x is read (pdl.py)
    ready();
    for (int kt = kt0; kt < kt1; kt += DEPTH) {
        if (kt + DEPTH < kt1) load_stage(nxt, tl, kt + DEPTH, kt1, cols, shift);
        mma_stage<F, MT, DEPTH, NT, XS>(cur, src, kt, kt1, cols, acc);
        cur = nxt;
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if constexpr (NT == 1) {
                v[mt][i] = acc[mt][0][i] + __shfl_down_sync(0xffffffffu, acc[mt][0][i], 2);
            } else {
                v[mt][i] = acc[mt][0][i] + acc[mt][1][i];
            }
        }
}

// The block's KW warps of one row group add their partial sums in warp order (deterministic);
// warp kw == 0 of the group ends with the totals in v. All warps of the block must call it.
template <int MT>
__device__ __forceinline__ void reduce_k(float (&v)[MT][4], int kw, int KW, float* red) {
    if (KW == 1) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();  // the previous item's readers are done
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[((warp * MT + mt) * 4 + i) * 32 + lane] = v[mt][i];
    __syncthreads();
    if (kw != 0) return;
    for (int j = 1; j < KW; j++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                v[mt][i] += red[(((warp + j) * MT + mt) * 4 + i) * 32 + lane];
}

// The k-tiles of warp kw of KW: a fixed share of ceil(cols / (4 CH)) by shape only.
template <class F>
__device__ __forceinline__ void k_span(int cols, int kw, int KW, int& kt0, int& kt1) {
    int tiles = (cols + 4 * F::CH - 1) / (4 * F::CH);
    kt0 = kw * tiles / KW;
    kt1 = (kw + 1) * tiles / KW;
}

// Output (row, column) of entry i of a lane's v.
__device__ __forceinline__ int out_row(int row0, int i) {
    return row0 + ((threadIdx.x & 31) >> 2) + 8 * (i >> 1);
}
__device__ __forceinline__ int out_col(int i) { return 2 * (threadIdx.x & 3) + (i & 1); }

// The lane's B column: batch slot n = g (NT = 2) or g & 3 (NT = 1, hi and lo halves).
template <int NT>
__device__ __forceinline__ int lane_slot() {
    int g = (threadIdx.x & 31) >> 2;
    return NT == 1 ? (g & 3) : g;
}


// The lane's XSrc for row `row` of x from column col0 (row < 0: no column): x + row * x_ld +
// col0, or (X_WORDS) the words xs + row * xs_ld, hi then lo from xs_ld / 2, at col0 (a multiple
// of 4 * CH).
template <class F, int NT, int XS>
__device__ __forceinline__ XSrc lane_src(const float* x, long long x_ld, const u32* xs,
                                         long long xs_ld, int row, long long col0) {
    if (row < 0) return XSrc{nullptr, nullptr, 0};
    if constexpr (XS == X_REGS) return XSrc{x + row * x_ld + col0, nullptr, 0};
    int t = threadIdx.x & 3, g = (threadIdx.x & 31) >> 2;
    long long half = xs_ld / 2, at = row * xs_ld + col0 / 2 + t * words_per_lane<F>();
    return XSrc{nullptr, xs + at + (NT == 1 && g >= 4 ? half : 0), half};
}

// x [n, >= K] (row stride x_ld) as format F's split words (lane_src's): out [n, out_ld], out_ld
// = 2 * KT * 2 * CH words (KT = ceil(K / (4 CH)) k-tiles), hi words then lo words, columns
// past K zero. Thread i makes word i of a row's hi part and the same word of its lo part.
template <class F>
__device__ void split_rows(const float* x, int n, int K, long long x_ld, u32* out,
                           long long out_ld, long long i) {
    constexpr int W = words_per_lane<F>();
    long long half = out_ld / 2;
    if (i >= n * half) return;
    long long row = i / half, j = i - row * half;
    int kt = (int)(j / (4 * W)), t = (int)(j / W) & 3, m = (int)(j % W) >> 1, r = (int)j & 1;
    long long c = (long long)kt * 4 * F::CH + t * F::CH;
    int c0 = (int)c + F::xcol(m, r, 0), c1 = (int)c + F::xcol(m, r, 1);
    const float k = F::SCALED ? X_SCALE : 1.f;
    const float* xr = x + row * x_ld;
    float v0 = c0 < K ? xr[c0] * k : 0.f, v1 = c1 < K ? xr[c1] * k : 0.f;
    u32 hi, lo;
    split_pair(v0, v1, hi, lo);
    out[row * out_ld + j] = hi;
    out[row * out_ld + half + j] = lo;
}

// Copies of 16 bytes into shared memory that need no registers; bytes < 16 zero the rest.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, int bytes) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(bytes)
                 : "memory");
}

// x rows b < batch (row stride x_ld, columns [0, cols)) as format F's B words in shared memory
// sx: per row KT k-tiles of 8 W words (hi words [lane t][W], then lo words), row after row,
// then (POST) un[b * KT + kt], the k-tile's power inverse. Thread 4 p + t splits chunk t of
// k-tile p (p = b * KT + kt) as lane t of a warp would (split_f16 / split_pair: the same
// words, so the same sums), 64 k-tiles a round of 256 threads, made once a block instead of
// once a warp and k-tile. Every thread of the block calls it; it ends on a barrier.
template <class F>
__device__ void stage_x(const float* x, long long x_ld, int batch, int cols, u32* sx) {
    constexpr int W = words_per_lane<F>(), TILE = 8 * W;  // words (= columns) a k-tile
    int KT = (cols + 4 * F::CH - 1) / (4 * F::CH), row4 = KT * TILE / 4;
    for (int i = threadIdx.x; i < batch * row4; i += blockDim.x) {  // the floats, zero past cols
        int b = i / row4, c = 4 * (i - b * row4), left = min(max(cols - c, 0), 4);
        copy16_async(sx + 4 * i, x + b * x_ld + (left > 0 ? c : 0), 4 * left);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    float* un = (float*)sx + batch * KT * TILE;
    int chunks = 4 * batch * KT, t = threadIdx.x & 3;
    for (int at = 0; at < chunks; at += blockDim.x) {  // every lane of a warp in each round
        int i = at + threadIdx.x, p = i >> 2;  // (a k-tile's four lanes agree on i < chunks)
        u32* tile = sx + (size_t)p * TILE;
        float xr[F::CH];
#pragma unroll
        for (int j = 0; j < F::CH; j += 4) {
            float4 f = i < chunks ? *(const float4*)(tile + t * F::CH + j)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
            xr[j] = f.x; xr[j + 1] = f.y; xr[j + 2] = f.z; xr[j + 3] = f.w;
        }
        u32 hi[F::MMAS][2], lo[F::MMAS][2];
        if constexpr (F::POST) {
            float u;
            split_f16<F>(xr, hi, lo, u);
            if (i < chunks && t == 0) un[p] = u;
        } else {
            const float k = F::SCALED ? X_SCALE : 1.f;
#pragma unroll
            for (int m = 0; m < F::MMAS; m++)
#pragma unroll
                for (int r = 0; r < 2; r++)
                    split_pair(xr[F::xcol(m, r, 0)] * k, xr[F::xcol(m, r, 1)] * k, hi[m][r],
                               lo[m][r]);
        }
        __syncwarp();  // the k-tile's four lanes have read its floats
        if (i >= chunks) continue;
        uint4* h4 = (uint4*)(tile + t * W);
        uint4* l4 = (uint4*)(tile + 4 * W + t * W);
#pragma unroll
        for (int q = 0; q < F::MMAS / 2; q++) {  // words 2m + r: two mmas a uint4
            h4[q] = make_uint4(hi[2 * q][0], hi[2 * q][1], hi[2 * q + 1][0], hi[2 * q + 1][1]);
            l4[q] = make_uint4(lo[2 * q][0], lo[2 * q][1], lo[2 * q + 1][0], lo[2 * q + 1][1]);
        }
    }
    __syncthreads();
}
