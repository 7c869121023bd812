// What the decode kernel families share: +inf for NVRTC, bf16 widening, packs of eight weights,
// a row dot product, warp and block reductions, a warp argmax, and the RoPE turn of one
// channel. Each ds4/kernels/*.cu includes it; NVRTC and nvcc find it through -I<ds4/kernels>.
#pragma once

#ifndef INFINITY  // NVRTC has no math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

// The architecture whose code paths are built: the target's, or an older one's given as
// -DDS4_ARCH=800 (ds4/kernels/__init__.py's DS4_CUDA_ARCH: how the gpu tests run the pre-Hopper
// paths on a Hopper).
#ifndef DS4_ARCH
#define DS4_ARCH __CUDA_ARCH__
#endif

// Programmatic dependent launch (ds4/kernels/pdl.py): in a kernel launched that way, nothing an
// earlier kernel writes or reads may be touched before wait_inputs() (the earlier grid is done
// and its writes visible), and every block reaches it. Only then may the next kernel's blocks be
// scheduled (so at most one kernel runs ahead, and the one before it is complete). Both
// instructions are no-ops in a plain launch; before sm_90 (no PDL) there is nothing to wait for.
#ifdef DS4_TIMELINE
// Built with -DDS4_TIMELINE only (ds4/kernels/timeline.py, tools/timeline_decode.py): block 0's
// thread 0 of each kernel stamps when it reached wait_inputs and when the kernel ahead let it go
// (the global timer, ns) into entry i of ds4_timeline, i from the buffer's count: [count, then
// per entry (reached, released, the launch's %gridid, its blocks << 32 | threads a block)]. A
// kernel that waits again (a loop over items) stamps again under the same grid id.
__device__ unsigned long long* ds4_timeline;
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
constexpr unsigned long long TIMELINE_ENTRIES = 4096;
#endif

__device__ __forceinline__ void wait_inputs() {
#ifdef DS4_TIMELINE
    unsigned long long reached = global_ns();
#endif
#if DS4_ARCH >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#ifdef DS4_TIMELINE
    if (ds4_timeline && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        unsigned long long released = global_ns(), i = atomicAdd(ds4_timeline, 1ull);
        if (i < TIMELINE_ENTRIES) {
            unsigned long long* e = ds4_timeline + 1 + 4 * i;
            e[0] = reached;
            e[1] = released;
            asm volatile("mov.u64 %0, %%gridid;" : "=l"(e[2]));
            e[3] = (unsigned long long)(gridDim.x * gridDim.y * gridDim.z) << 32 |
                   blockDim.x * blockDim.y * blockDim.z;
        }
    }
#endif
}

// A hint that `bytes` (a multiple of 16) from p (16-byte aligned) will be read soon: one bulk
// request brings them into the L2 (no registers, no wait). Elsewhere (sm < 90, misaligned) none.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if DS4_ARCH >= 900
    if (bytes > 0 && bytes % 16 == 0 && (reinterpret_cast<unsigned long long>(p) & 15) == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Four E4M3 codes (bytes of q, low first) as two f16x2 words lo = (code 0, code 1), hi =
// (code 2, code 3), exactly. Before sm_89 (no cvt from e4m3x2: A100, RTX 30xx) by bit moves: the
// sign to bit 15 and the seven other bits to bits 13..7 make the code's value times 2^-8 (an
// E4M3 subnormal lands on an f16 subnormal), and an f16x2 multiply by 2^8 gives it back exactly
// (there the NaN codes, which no checkpoint holds, come out finite).
__device__ __forceinline__ void e4m3x4(unsigned int q, unsigned int& lo, unsigned int& hi) {
#if DS4_ARCH >= 890
    asm("{.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, a;\n\t"
        "cvt.rn.f16x2.e4m3x2 %1, b;}" : "=r"(lo), "=r"(hi) : "r"(q));
#else
    const unsigned int S = 0x80008000u, M = 0x3f803f80u, TWO8 = 0x5c005c00u;  // 2^8 in f16
    unsigned int a = __byte_perm(q, 0u, 0x4140u), b = __byte_perm(q, 0u, 0x4342u);
    a = ((a << 8) & S) | ((a << 7) & M);
    b = ((b << 8) & S) | ((b << 7) & M);
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(lo) : "r"(a), "r"(TWO8));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(hi) : "r"(b), "r"(TWO8));
#endif
}

// Bits of a where c is set, of b elsewhere: one LOP3, in asm so that the compiler does not
// distribute the shifts that follow it back over the select.
__device__ __forceinline__ unsigned int select_bits(unsigned int a, unsigned int b,
                                                    unsigned int c) {
    unsigned int r;
    asm("lop3.b32 %0, %1, %2, %3, 0xe4;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// E2M1 pairs 2u and 2u + 1 of a word of eight codes (pair i: codes i and i + 4, low nibble
// first) as bf16x2 words lo, hi: each code s|eem as (s << 15) | (eem << 6), its value times
// 2^-126 (the subnormal 0.5 lands on a bf16 subnormal). A code's sign sits 3 bits above its
// magnitude's low bit and the word needs 9: one select first moves the word's signs 6 up (u =
// 0) or its magnitudes 6 down (u = 1) for both pairs, then each pair is one shift and one mask
// (11 instructions for four pairs, where two shifts a pair took 16; the same bits).
__device__ __forceinline__ void e2m1_pairs(unsigned int w, int u, unsigned int& lo,
                                           unsigned int& hi) {
    const unsigned int P = 0x81c081c0u, KA = 0x00770077u, KB = 0x01dc01dcu;
    if (u == 0) {
        unsigned int z = select_bits(w, w << 6, KA);
        lo = (z << 6) & P, hi = (z << 2) & P;
    } else {
        unsigned int z = select_bits(w >> 6, w, KB);
        lo = (z << 4) & P, hi = z & P;
    }
}

// A bf16 word widens by a 16-bit shift into a float's high half (exact), so bf16 weights stay
// bf16 in device memory and every byte is read once.
__device__ __forceinline__ float widen(unsigned short w) {
    return __uint_as_float((unsigned int)w << 16);
}
__device__ __forceinline__ float widen(float w) { return w; }
__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) {
    return __uint_as_float(w & 0xffff0000u);
}

// Eight consecutive weights of one row: one 16-byte load for bf16, two for fp32.
template <typename W> struct Pack;

template <> struct Pack<unsigned short> {
    uint4 v;
    __device__ __forceinline__ void load(const unsigned short* w, int i) {
        v = __ldcs((const uint4*)w + i);
    }
    __device__ __forceinline__ float dot(const float4* x) const {
        float4 a = x[0], b = x[1];
        return bf16_lo(v.x) * a.x + bf16_hi(v.x) * a.y + bf16_lo(v.y) * a.z + bf16_hi(v.y) * a.w
             + bf16_lo(v.z) * b.x + bf16_hi(v.z) * b.y + bf16_lo(v.w) * b.z + bf16_hi(v.w) * b.w;
    }
};

template <> struct Pack<float> {
    float4 p, q;
    __device__ __forceinline__ void load(const float* w, int i) {
        p = __ldcs((const float4*)w + 2 * i);
        q = __ldcs((const float4*)w + 2 * i + 1);
    }
    __device__ __forceinline__ float dot(const float4* x) const {
        float4 a = x[0], b = x[1];
        return p.x * a.x + p.y * a.y + p.z * a.z + p.w * a.w
             + q.x * b.x + q.y * b.y + q.z * b.z + q.w * b.w;
    }
};

// Pack i of row w dotted with x: the tail of every row loop, one 16-byte load at a time.
template <typename W>
__device__ __forceinline__ float pack_dot(const W* w, const float4* xv, int i) {
    Pack<W> a;
    a.load(w, i);
    return a.dot(xv + 2 * i);
}

// Adds this lane's share of one row's n8 packs dotted with x to acc[0..3] (one warp per row;
// four independent 16-byte loads in flight per lane before the first use).
template <typename W>
__device__ __forceinline__ void row_dot_partial(const W* w, const float4* xv, int n8, float* acc) {
    int i = threadIdx.x & 31;
    for (; i + 96 < n8; i += 128) {
        Pack<W> a, b, c, d;
        a.load(w, i); b.load(w, i + 32); c.load(w, i + 64); d.load(w, i + 96);
        acc[0] += a.dot(xv + 2 * i);
        acc[1] += b.dot(xv + 2 * (i + 32));
        acc[2] += c.dot(xv + 2 * (i + 64));
        acc[3] += d.dot(xv + 2 * (i + 96));
    }
    for (; i < n8; i += 32) acc[0] += pack_dot(w, xv, i);
}

// Sum of v over the warp (every lane gets it), for floats, doubles and ints alike.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The warp's total of row_dot_partial's four accumulators, added in this order (the rounding
// every kernel and its NumPy twin agree on).
__device__ __forceinline__ float warp_sum4(const float* acc) {
    return warp_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
}

// Dot product of one row's n8 packs with x, by one warp; every lane gets the sum.
template <typename W>
__device__ __forceinline__ float row_dot(const W* w, const float4* xv, int n8) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    row_dot_partial(w, xv, n8, acc);
    return warp_sum4(acc);
}

// The larger of (v, i) over the warp, ties to the lower index; every lane gets both.
__device__ __forceinline__ void warp_argmax(float& value, int& index) {
    float v = value;
    int i = index;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    value = v;
    index = i;
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (or max) of v over the block; every thread gets the result. `shared` holds 32 values.
template <bool MAX, typename T>
__device__ __forceinline__ T block_reduce(T v, T* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) / 32;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    T t = threadIdx.x < nw ? shared[threadIdx.x] : (MAX ? T(-INFINITY) : T(0));
    if (warp == 0) t = MAX ? warp_max(t) : warp_sum(t);
    if (threadIdx.x == 0) shared[0] = t;
    __syncthreads();
    return shared[0];
}

template <typename T>
__device__ __forceinline__ T block_sum(T v, T* shared) {
    return block_reduce<false>(v, shared);
}
__device__ __forceinline__ float block_max(float v, float* shared) {
    return block_reduce<true>(v, shared);
}

// Channel c of `row` (first = where the trailing rope channels start) after RoPE at position
// pos: pair k turns by pos * freqs[k], the angle in float64 as the NumPy engine forms it.
__device__ __forceinline__ float rope_channel(const float* row, int c, int first, double pos,
                                              const double* __restrict__ freqs) {
    if (c < first) return row[c];
    int k = (c - first) >> 1;
    double ds, dc;
    sincos(pos * freqs[k], &ds, &dc);
    float s = (float)ds, co = (float)dc;
    float a = row[first + 2 * k], b = row[first + 2 * k + 1];
    return ((c - first) & 1) ? a * s + b * co : a * co - b * s;
}

// Keys per split of the split decode attention (attention.cu, mtp.cu): one per lane of a warp.
constexpr int SPLIT_KEYS = 32;

// Row stride (floats) of the staged keys: float4 rows (width a multiple of 4); for the scores
// 16-byte reads, a lane's row starts 4 banks after its neighbour's, so a warp's reads take the
// four passes its 512 bytes need anyway, and the value pass reads columns conflict-free.
__device__ __forceinline__ int key_stride(int width) { return width + 4; }

// dst[r * stride ..] = row r of `count` rows of width floats (width % 4 == 0), row r read from
// row(r) (a float4 pointer; null: a row of zeros), by the block's threads: thread t takes
// float4 t, t + blockDim.x, ... of the count x width / 4 block, eight 16-byte loads in flight
// before any store (the staging is latency bound). A float4's (row, column) steps by
// blockDim.x / w4 rows and blockDim.x % w4 columns, not by a division per float4 (two
// divisions and the row's address a float4 were ~110 instructions, half an attention partial's).
template <class Row>
__device__ __forceinline__ void stage_rows(float* dst, int count, int width, int stride,
                                           Row row) {
    int w4 = width >> 2, dr = blockDim.x / w4, dc = blockDim.x % w4;
    int r = threadIdx.x / w4, c = threadIdx.x % w4;
    while (r < count) {
        float4 v[8];
        int rs[8], cs[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            rs[u] = r, cs[u] = c;
            if (r < count) {
                const float4* p = row(r);
                v[u] = p ? __ldg(p + c) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
            r += dr, c += dc;
            if (c >= w4) r++, c -= w4;
        }
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (rs[u] < count) *(float4*)(dst + rs[u] * stride + 4 * cs[u]) = v[u];
    }
}

// The key rows rows[0..count) into ks (rows of key_stride(width) floats).
__device__ __forceinline__ void stage_key_rows(float* ks, const float* const* rows, int count,
                                               int width, int stride) {
    stage_rows(ks, count, width, stride, [&](int r) { return (const float4*)rows[r]; });
}

// One channel part's dots of HH query heads (q, rows of width floats, from the part's first
// channel) with keys j and j + 16 (staged rows of `stride` floats from ks): four chains a head
// and key over span4 float4s, as one key a lane would add them, into dots[hh * SPLIT_KEYS +
// key]. Each float4 of q read serves two keys and each of a key HH heads. Rows at or past the
// split's count hold stale floats: their dots are never read.
template <int HH>
__device__ __forceinline__ void part_dots(const float* q, const float* ks, int stride,
                                          int width, int span4, int j, float* dots) {
    float a[2][HH][4] = {};
    const float4* k0 = (const float4*)(ks + j * stride);
    const float4* k1 = (const float4*)(ks + (j + 16) * stride);
    for (int c = 0; c < span4; c++) {
        float4 u = k0[c], v = k1[c];
#pragma unroll
        for (int hh = 0; hh < HH; hh++) {
            float4 qv = ((const float4*)(q + hh * width))[c];
            a[0][hh][0] += qv.x * u.x;
            a[0][hh][1] += qv.y * u.y;
            a[0][hh][2] += qv.z * u.z;
            a[0][hh][3] += qv.w * u.w;
            a[1][hh][0] += qv.x * v.x;
            a[1][hh][1] += qv.y * v.y;
            a[1][hh][2] += qv.z * v.z;
            a[1][hh][3] += qv.w * v.w;
        }
    }
#pragma unroll
    for (int hh = 0; hh < HH; hh++)
#pragma unroll
        for (int k = 0; k < 2; k++)
            dots[hh * SPLIT_KEYS + j + 16 * k] = (a[k][hh][0] + a[k][hh][1])
                                                 + (a[k][hh][2] + a[k][hh][3]);
}

// The partial softmax of one split once its `count` keys are staged (ks, row stride
// key_stride(width)) beside the block's HPB query heads (qs): for the scores warp w takes part
// w of 8 parts of the channels (fewer where the width does not split into them) and each lane
// two keys for half the heads (part_dots: a float4 of a key serves several heads and one of a
// query two keys; reading each once per product bounded the kernel by shared-memory traffic),
// and each head adds its parts in part order; then two channels for all heads per thread, four
// keys' weights a float4, so each weight read serves both channels and each staged key value
// HPB accumulators (adding keys in order). part[(head * splits + split)] = (max, sum of exp,
// weighted sum [width]). 256 threads. HPB is a template argument so the head loops unroll
// without a branch a head: with a runtime count every shared-memory read waited for the one
// before it (one load in flight a warp).
template <int HPB>
__device__ __forceinline__ void staged_partial_h(const float* qs, const float* ks, float* ps,
                                                 int stride, int width, int count, float scale,
                                                 float* part, int h0, int split, int splits,
                                                 float* dots) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int parts = 8;
    while (parts > 1 && width % (4 * parts) != 0) parts >>= 1;
    if (warp < parts) {
        int span4 = width / parts / 4, c0 = warp * span4 * 4;
        constexpr int HH = HPB > 1 ? HPB / 2 : 1;  // heads a lane (one head: lanes 16.. idle)
        int half = lane >> 4;
        if (half * HH < HPB)
            part_dots<HH>(qs + half * HH * width + c0, ks + c0, stride, width, span4,
                          lane & 15, dots + (warp * 8 + half * HH) * SPLIT_KEYS);
    }
    __syncthreads();
    if (warp < HPB) {
        float s = -INFINITY;
        if (lane < count) {
            s = dots[warp * SPLIT_KEYS + lane];
            for (int p = 1; p < parts; p++) s += dots[(p * 8 + warp) * SPLIT_KEYS + lane];
            s *= scale;
        }
        float m = warp_max(s);
        float p = lane < count ? expf(s - m) : 0.f;
        float l = warp_sum(p);
        ps[warp * SPLIT_KEYS + lane] = p;
        if (lane == 0) {
            float* dst = part + ((size_t)(h0 + warp) * splits + split) * (width + 2);
            dst[0] = m;
            dst[1] = l;
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < width; c += 2 * blockDim.x) {
        // two channels a thread where the width has them: each weight read serves both
        int c2 = c + blockDim.x < width ? c + blockDim.x : c;
        float acc[HPB] = {}, acc2[HPB] = {};
        int e = 0;
        for (; e + 4 <= count; e += 4) {
            const float* k = ks + e * stride;
            float k0 = k[c], k1 = k[stride + c], k2 = k[2 * stride + c], k3 = k[3 * stride + c];
            float j0 = k[c2], j1 = k[stride + c2], j2 = k[2 * stride + c2];
            float j3 = k[3 * stride + c2];
#pragma unroll
            for (int hh = 0; hh < HPB; hh++) {
                float4 w = *(const float4*)(ps + hh * SPLIT_KEYS + e);
                acc[hh] += w.x * k0;
                acc[hh] += w.y * k1;
                acc[hh] += w.z * k2;
                acc[hh] += w.w * k3;
                acc2[hh] += w.x * j0;
                acc2[hh] += w.y * j1;
                acc2[hh] += w.z * j2;
                acc2[hh] += w.w * j3;
            }
        }
        for (; e < count; e++) {
            float k = ks[e * stride + c], j = ks[e * stride + c2];
#pragma unroll
            for (int hh = 0; hh < HPB; hh++) {
                acc[hh] += ps[hh * SPLIT_KEYS + e] * k;
                acc2[hh] += ps[hh * SPLIT_KEYS + e] * j;
            }
        }
#pragma unroll
        for (int hh = 0; hh < HPB; hh++) {
            float* o = part + ((size_t)(h0 + hh) * splits + split) * (width + 2) + 2;
            o[c] = acc[hh];
            if (c2 != c) o[c2] = acc2[hh];
        }
    }
}

// staged_partial_h for the block's hpb (1, 2, 4 or 8) heads.
__device__ __forceinline__ void staged_partial(const float* qs, const float* ks, float* ps,
                                               int stride, int width, int count, int hpb,
                                               float scale, float* part, int h0, int split,
                                               int splits) {
    __shared__ float dots[8 * 8 * SPLIT_KEYS];  // [part][head][key] of the split scores
    if (hpb == 8)
        staged_partial_h<8>(qs, ks, ps, stride, width, count, scale, part, h0, split, splits,
                            dots);
    else if (hpb == 4)
        staged_partial_h<4>(qs, ks, ps, stride, width, count, scale, part, h0, split, splits,
                            dots);
    else if (hpb == 2)
        staged_partial_h<2>(qs, ks, ps, stride, width, count, scale, part, h0, split, splits,
                            dots);
    else
        staged_partial_h<1>(qs, ks, ps, stride, width, count, scale, part, h0, split, splits,
                            dots);
}
