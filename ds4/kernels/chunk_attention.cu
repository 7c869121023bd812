// Prefill attention of one chunk (docs/MODEL.md, Attention), flash style on tensor cores.
//
// Query i (position t = start + i) of the chunk sees, in this order: its raw window (ring rows
// while i < W, then chunk rows up to itself; a row counts when t - W < its position <= t) and
// its compressed rows: the first min(count, (t + 1) / ratio) ones, or its own indexer picks
// (-1 = nothing there). One shared K = V head; each head h has a sink logit s_h that joins the
// softmax's denominator and adds no value. The online softmax starts at (max s_h, sum 1), so
// the sink is just the first term.
//
// A block takes 32 heads of one query at a time (8 warps, 256 threads; one block per SM walks
// a stream of queries) and its keys in tiles of 32 rows staged in shared memory with cp.async
// (two stages: the next tile, or the next query's q rows and first tile, load while this one
// is used). fp32 enters the bf16 mma.sync m16n8k16 as hi + lo words (x = hi + lo + r,
// |r| <= 2^-16 |x|); each product takes hi*hi + hi*lo + lo*hi with fp32 accumulation, so scores
// and outputs keep fp32-class accuracy (the keys' words come from ds4/kernels/split.cu). With
// P = 1 word per value (DS4_GEMM=bf16) every operand is rounded once: a third of the products
// and half the staged bytes, ~3e-3 relative. R < D: only the last R dims of a key have lo
// words; the first D - R are exact in bf16 (the official FP8 KV rounding leaves 4 significant
// bits there), so their lo words are zero: they are neither staged nor multiplied, and every
// sum is the same (a product with a zero word adds exactly nothing).
//   scores: warp (m, kq) holds heads 16m..16m+15 of the query as A fragments in registers for
//           its quarter of the head dims, and sums q . k over that quarter for the 32 keys; the
//           four quarters meet in shared memory;
//   softmax: 8 threads per head (4 keys each) find the tile's max, rescale, write p as words;
//   values: warp (m, dq) keeps o for its 16 heads and quarter of the dims (fp32 registers).

#include "common.cuh"

#define HEADS 32   // heads of a block
#define TILE 32    // keys of a tile
#define THREADS 256
#define PSTRIDE (TILE + 8)  // p words per head row (+8: conflict-free ldmatrix rows)

__device__ __forceinline__ unsigned short bf16_round(float v) {
    unsigned int b = __float_as_uint(v);
    return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);  // nearest, ties to even
}

// Two fp32 values as (hi, lo) pairs of packed bf16 words, the lower index in the low half.
__device__ __forceinline__ void split_pair(float a, float b, unsigned int& hi, unsigned int& lo) {
    unsigned short ha = bf16_round(a), hb = bf16_round(b);
    unsigned short la = bf16_round(a - widen(ha)), lb = bf16_round(b - widen(hb));
    hi = (unsigned int)ha | ((unsigned int)hb << 16);
    lo = (unsigned int)la | ((unsigned int)lb << 16);
}

__device__ __forceinline__ void mma_bf16(float* c, const unsigned int* a, unsigned int b0,
                                         unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// hi*hi + hi*lo + lo*hi: the product of two split operands to ~2^-16 relative (P = 2), or
// hi*hi alone (P = 1); b_lo false: b's lo words are zero, so hi*lo adds nothing and is skipped.
template <int P>
__device__ __forceinline__ void mma_split(float* c, const unsigned int* ah, const unsigned int* al,
                                          const unsigned int* bh, const unsigned int* bl,
                                          bool b_lo = true) {
    if (P == 2) {
        mma_bf16(c, al, bh[0], bh[1]);
        if (b_lo) mma_bf16(c, ah, bl[0], bl[1]);
    }
    mma_bf16(c, ah, bh[0], bh[1]);
}

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void ldmatrix_x4(unsigned int* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// 16 bytes global -> shared; bytes == 0 writes zeros (a key that is not there).
__device__ __forceinline__ void copy16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_group 0;\n" ::); }

// Where query i's keys are: raw = [2, W + S, D] words (ring rows, then the chunk's rows; hi
// block, then lo block), comp = [2, count, D] words, picks = [S, pick_width] or null.
struct Keys {
    const unsigned short* raw;
    const unsigned short* comp;
    const int* picks;
    int pick_width, count, ratio, start, window, chunk;
};

// Key j of query i: the hi word row (null when the key is not there; its lo row is
// `rows` rows further on).
struct KeyRow {
    const unsigned short* hi;
    long long rows;
};

struct Query {
    int i, t, first, n_window, n_comp;
};

__device__ __forceinline__ Query query_of(const Keys& k, int i) {
    Query q;
    q.i = i;
    q.t = k.start + i;
    q.first = i < k.window ? 0 : i + 1;  // ring rows only while the window reaches back there
    q.n_window = i < k.window ? k.window + i + 1 : k.window;
    q.n_comp = 0;
    if (k.ratio > 0 && k.count > 0)
        q.n_comp = k.picks ? k.pick_width : min(k.count, (q.t + 1) / k.ratio);
    return q;
}

template <int D>
__device__ __forceinline__ KeyRow key_row(const Keys& k, const Query& q, int j) {
    KeyRow r = {nullptr, 0};
    if (j < q.n_window) {
        int row = q.first + j, W = k.window;
        int pos = row < W ? k.start - 1 - (((k.start - 1 - row) % W) + W) % W : k.start + row - W;
        if (pos >= 0 && pos <= q.t && pos > q.t - W) {
            r.hi = k.raw + (size_t)row * D;
            r.rows = (long long)(W + k.chunk) * D;
        }
        return r;
    }
    j -= q.n_window;
    if (j >= q.n_comp) return r;
    int id = k.picks ? k.picks[(size_t)q.i * k.pick_width + j] : j;
    if (id >= 0 && id < k.count) {
        r.hi = k.comp + (size_t)id * D;
        r.rows = (long long)k.count * D;
    }
    return r;
}

// Stages keys [j0, j0 + TILE) of query q (hi word rows, then for P = 2 the lo words of the
// last R dims) into ks [P][TILE][D + 8]. Lane l finds key j0 + l once; the copies take its row
// by a shuffle.
template <int D, int P, int R>
__device__ __forceinline__ void stage_tile(const Keys& k, const Query& q, int j0,
                                           unsigned short* ks) {
    constexpr int CHUNKS = D / 8;  // 16-byte pieces of one word row
    constexpr int PIECES = CHUNKS + (P - 1) * R / 8;  // pieces of one key: hi row + lo part
    constexpr int PER_THREAD = TILE * PIECES / THREADS;
    static_assert(TILE * PIECES % THREADS == 0 && R % 64 == 0 && R <= D, "tile pieces");
    KeyRow mine = key_row<D>(k, q, j0 + (threadIdx.x & 31));
    unsigned long long mine_hi = (unsigned long long)mine.hi;
#pragma unroll 4
    for (int u = 0; u < PER_THREAD; u++) {
        int c = threadIdx.x + u * THREADS;
        int key = c / PIECES, rem = c % PIECES;
        int part = rem < CHUNKS ? 0 : 1;
        int piece = part ? rem - CHUNKS + (D - R) / 8 : rem;
        const unsigned short* hi = (const unsigned short*)__shfl_sync(0xffffffffu, mine_hi, key);
        long long rows = __shfl_sync(0xffffffffu, mine.rows, key);
        const unsigned short* src = hi ? hi + part * rows + piece * 8 : k.raw;
        copy16(ks + ((size_t)part * TILE + key) * (D + 8) + piece * 8, src, hi ? 16 : 0);
    }
    copies_commit();
}

template <int D, int P>
struct Smem {
    unsigned short keys[2][P][TILE][D + 8];  // [stage][hi, lo][key][dim]
    float q[HEADS][D + 8];                   // the next query's heads, fp32 (+8: fewer conflicts)
    float partial[4][HEADS][TILE + 1];       // scores per quarter of the dims
    unsigned short p[P][HEADS][PSTRIDE];     // [hi, lo][head][key]
    float m[HEADS], l[HEADS], alpha[HEADS];
};

// Stages heads h0.. of query i (zeros past H) into sm.q.
template <int D, int P>
__device__ __forceinline__ void stage_query(Smem<D, P>& sm, const float* q, int i, int H,
                                            int h0) {
    constexpr int CHUNKS = D / 4;  // 16-byte pieces of one fp32 row
#pragma unroll 4
    for (int u = 0; u < HEADS * CHUNKS / THREADS; u++) {
        int c = threadIdx.x + u * THREADS, head = c / CHUNKS, piece = c % CHUNKS;
        int h = min(h0 + head, H - 1);
        copy16(&sm.q[head][piece * 4], q + ((size_t)i * H + h) * D + piece * 4,
               h0 + head < H ? 16 : 0);
    }
    copies_commit();
}

// Warp (mt, kq)'s A fragments: heads 16mt.. of the staged query over dims
// [kq * D / 4, (kq + 1) * D / 4) as hi and lo words.
template <int D, int P>
__device__ __forceinline__ void load_query(const Smem<D, P>& sm, int mt, int kq,
                                           unsigned int (*qh)[4], unsigned int (*ql)[4]) {
    constexpr int KS = D / 64;  // k16 steps of a quarter
    int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int s = 0; s < KS; s++) {
#pragma unroll
        for (int f = 0; f < 4; f++) {  // a0: (g, 2c) a1: (g + 8, 2c) a2: (g, 2c + 8) a3: both
            int head = mt * 16 + g + (f & 1) * 8;
            int col = kq * (D / 4) + s * 16 + 2 * c + (f >> 1) * 8;
            float2 v = *(const float2*)&sm.q[head][col];
            split_pair(v.x, v.y, qh[s][f], ql[s][f]);
        }
    }
}

// Partial scores of warp (mt, kq) for the tile's 32 keys -> sm.partial[kq].
template <int D, int P, int R>
__device__ __forceinline__ void tile_scores(Smem<D, P>& sm, int stage, int mt, int kq,
                                            unsigned int (*qh)[4], unsigned int (*ql)[4]) {
    constexpr int KS = D / 64;
    int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    float s[4][4] = {};
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        int col = kq * (D / 4) + ks * 16 + ((lane >> 3) & 1) * 8;
        bool lo = kq * (D / 4) + ks * 16 >= D - R;  // the keys' lo words are there (warp-wide)
#pragma unroll
        for (int np = 0; np < 2; np++) {  // two n8 key tiles per ldmatrix.x4
            int key = np * 16 + (lane & 7) + (lane >> 4) * 8;
            unsigned int bh[4], bl[4] = {};
            ldmatrix_x4(bh, &sm.keys[stage][0][key][col]);
            if (P == 2 && lo) ldmatrix_x4(bl, &sm.keys[stage][P - 1][key][col]);
            mma_split<P>(s[2 * np], qh[ks], ql[ks], bh, bl, lo);
            mma_split<P>(s[2 * np + 1], qh[ks], ql[ks], bh + 2, bl + 2, lo);
        }
    }
#pragma unroll
    for (int nt = 0; nt < 4; nt++) {
        int head = mt * 16 + g, key = nt * 8 + 2 * c;
        sm.partial[kq][head][key] = s[nt][0];
        sm.partial[kq][head][key + 1] = s[nt][1];
        sm.partial[kq][head + 8][key] = s[nt][2];
        sm.partial[kq][head + 8][key + 1] = s[nt][3];
    }
}

// Online softmax of the tile: 8 threads per head, 4 keys each (`present`: bit e = key j0 + e
// is there). Updates m, l and alpha (the rescale of what o held); writes p as words.
template <int D, int P>
__device__ __forceinline__ void tile_softmax(Smem<D, P>& sm, unsigned int present, float scale) {
    int head = threadIdx.x >> 3, k0 = (threadIdx.x & 7) * 4;
    float s[4], top = -INFINITY;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float v = sm.partial[0][head][k0 + e] + sm.partial[1][head][k0 + e]
                + sm.partial[2][head][k0 + e] + sm.partial[3][head][k0 + e];
        s[e] = (present >> (k0 + e)) & 1u ? v * scale : -INFINITY;
        top = fmaxf(top, s[e]);
    }
    for (int o = 1; o < 8; o <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    float m_old = sm.m[head], m_new = fmaxf(m_old, top), sum = 0.f;
    unsigned int hi[2], lo[2];
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
        float a = expf(s[e] - m_new), b = expf(s[e + 1] - m_new);
        sum += a + b;
        split_pair(a, b, hi[e / 2], lo[e / 2]);
    }
    for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    *(uint2*)&sm.p[0][head][k0] = make_uint2(hi[0], hi[1]);
    if (P == 2) *(uint2*)&sm.p[P - 1][head][k0] = make_uint2(lo[0], lo[1]);
    if ((threadIdx.x & 7) == 0) {
        float alpha = expf(m_old - m_new);
        sm.m[head] = m_new;
        sm.l[head] = sm.l[head] * alpha + sum;
        sm.alpha[head] = alpha;
    }
}

// o of warp (mt, dq) = alpha o + p V over the tile (V = the staged keys).
template <int D, int P, int R>
__device__ __forceinline__ void tile_values(Smem<D, P>& sm, int stage, int mt, int dq,
                                            float (*o)[4]) {
    constexpr int NT = D / 32;  // n8 dim tiles of a quarter
    int lane = threadIdx.x & 31, g = lane >> 2;
    float a0 = sm.alpha[mt * 16 + g], a1 = sm.alpha[mt * 16 + g + 8];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        o[nt][0] *= a0; o[nt][1] *= a0; o[nt][2] *= a1; o[nt][3] *= a1;
    }
#pragma unroll
    for (int ks = 0; ks < TILE / 16; ks++) {
        unsigned int ph[4], pl[4];
        int row = mt * 16 + (lane & 15), col = ks * 16 + (lane >> 4) * 8;
        ldmatrix_x4(ph, &sm.p[0][row][col]);
        if (P == 2) ldmatrix_x4(pl, &sm.p[P - 1][row][col]);
        int key = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {  // two n8 dim tiles per ldmatrix.x4.trans
            int dim = dq * (D / 4) + np * 16 + (lane >> 4) * 8;
            bool lo = dq * (D / 4) + np * 16 >= D - R;  // (warp-wide)
            unsigned int vh[4], vl[4] = {};
            ldmatrix_x4_trans(vh, &sm.keys[stage][0][key][dim]);
            if (P == 2 && lo) ldmatrix_x4_trans(vl, &sm.keys[stage][P - 1][key][dim]);
            mma_split<P>(o[2 * np], ph, pl, vh, vl, lo);
            mma_split<P>(o[2 * np + 1], ph, pl, vh + 2, vl + 2, lo);
        }
    }
}

template <int D, int P>
__device__ __forceinline__ void store_output(const Smem<D, P>& sm, float* out, int i, int H,
                                             int h0, int mt, int dq, float (*o)[4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int head = mt * 16 + g + half * 8, h = h0 + head;
        if (h >= H) continue;
        float inv = 1.f / sm.l[head];
        float* dst = out + ((size_t)i * H + h) * D + dq * (D / 4) + 2 * c;
#pragma unroll
        for (int nt = 0; nt < D / 32; nt++)
            *(float2*)(dst + nt * 8) = make_float2(o[nt][2 * half] * inv,
                                                   o[nt][2 * half + 1] * inv);
    }
}

__device__ __forceinline__ int tiles_of(const Query& q) {
    return (q.n_window + q.n_comp + TILE - 1) / TILE;
}

// out [S, H, D] from q [S, H, D] (fp32). Grid (G, ceil(H / 32)), 256 threads, dynamic shared
// memory sizeof(Smem<D, P>). Block x takes queries x, x + G, ... as one stream of tiles: the
// next tile (or the next query's first tile and its q rows) loads while this one is used, so a
// query's start costs no exposed load.
template <int D, int P, int R>
__device__ void chunk_attention(const float* __restrict__ q, Keys k,
                                const float* __restrict__ sinks, float* __restrict__ out, int H,
                                float scale) {
    extern __shared__ uint4 smem_words[];  // uint4: 16-byte aligned for cp.async and ldmatrix
    Smem<D, P>& sm = *reinterpret_cast<Smem<D, P>*>(smem_words);
    int h0 = blockIdx.y * HEADS, warp = threadIdx.x >> 5;
    int mt = warp >> 2, quarter = warp & 3;
    Query qr = query_of(k, blockIdx.x);
    int tile = 0, stage = 0;
    stage_query<D, P>(sm, q, qr.i, H, h0);
    stage_tile<D, P, R>(k, qr, 0, &sm.keys[0][0][0][0]);
    unsigned int qh[D / 64][4], ql[D / 64][4];
    float o[D / 32][4] = {};
    while (true) {
        copies_wait();
        __syncthreads();  // this tile (and q) is in; the previous tile's values pass is done
        if (tile == 0) {
            if (threadIdx.x < HEADS) {
                int h = h0 + threadIdx.x;
                sm.m[threadIdx.x] = h < H ? sinks[h] : 0.f;  // the sink: exp(s_h - m) = 1 term
                sm.l[threadIdx.x] = 1.f;
            }
            load_query<D, P>(sm, mt, quarter, qh, ql);
        }
        bool last = tile + 1 == tiles_of(qr);
        Query nq = last ? query_of(k, qr.i + gridDim.x) : qr;
        int next = last ? 0 : tile + 1;
        bool more = nq.i < k.chunk;
        if (more) stage_tile<D, P, R>(k, nq, next * TILE, &sm.keys[stage ^ 1][0][0][0]);
        unsigned int present = __ballot_sync(
            0xffffffffu, key_row<D>(k, qr, tile * TILE + (threadIdx.x & 31)).hi != nullptr);
        tile_scores<D, P, R>(sm, stage, mt, quarter, qh, ql);
        __syncthreads();  // every warp has its q fragments: sm.q may take the next query's
        if (more && next == 0) stage_query<D, P>(sm, q, nq.i, H, h0);
        tile_softmax<D, P>(sm, present, scale);
        __syncthreads();
        tile_values<D, P, R>(sm, stage, mt, quarter, o);
        if (last) {
            store_output<D, P>(sm, out, qr.i, H, h0, mt, quarter, o);
#pragma unroll
            for (int nt = 0; nt < D / 32; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
        }
        if (!more) break;
        qr = nq;
        tile = next;
        stage ^= 1;
    }
}

// chunk_attention_d{D}_x{P}: every dim with lo words; ..._r{R}: only the last R dims (the
// rest exact in bf16: FP8-rounded KV rows).
#define CHUNK_ATTENTION(D, P, R, NAME)                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                             \
        const float* __restrict__ q, const unsigned short* raw, const unsigned short* comp,     \
        const int* picks, int pick_width, int count, int ratio, int start, int window,         \
        int chunk, const float* __restrict__ sinks, float* __restrict__ out, int H,            \
        float scale) {                                                                         \
        Keys k = {raw, comp, picks, pick_width, count, ratio, start, window, chunk};           \
        chunk_attention<D, P, R>(q, k, sinks, out, H, scale);                                  \
    }

CHUNK_ATTENTION(64, 1, 64, chunk_attention_d64_x1)
CHUNK_ATTENTION(64, 2, 64, chunk_attention_d64_x2)
CHUNK_ATTENTION(128, 1, 128, chunk_attention_d128_x1)
CHUNK_ATTENTION(128, 2, 128, chunk_attention_d128_x2)
CHUNK_ATTENTION(128, 2, 64, chunk_attention_d128_x2_r64)
CHUNK_ATTENTION(256, 1, 256, chunk_attention_d256_x1)
CHUNK_ATTENTION(256, 2, 256, chunk_attention_d256_x2)
CHUNK_ATTENTION(256, 2, 64, chunk_attention_d256_x2_r64)
CHUNK_ATTENTION(512, 1, 512, chunk_attention_d512_x1)
CHUNK_ATTENTION(512, 2, 512, chunk_attention_d512_x2)
CHUNK_ATTENTION(512, 2, 64, chunk_attention_d512_x2_r64)
