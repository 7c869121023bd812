// The row kernels' weights through a ring in shared memory (rows_moe.cu's ring kernels,
// rows_moe.py's RING): warp_rows' stages copied by cp.async, several in flight a warp.
#pragma once

#include "rows.cuh"

// The weights through a ring of S stages in shared memory instead (ring_rows): each lane
// copies its own codes of a stage with cp.async, and for scaled formats the aligned word that
// holds each scale byte, so S - 1 stages are in flight a warp while registers hold only the
// one being multiplied (the register stages hold two at most). A warp's slot: N uint4 of codes
// then M scale words a lane, lane-minor, so a warp's 16-byte accesses are 512 bytes in a row.
constexpr int RING_WARP_BYTES = 12800;  // a warp's ring (rows_moe.py's RING_WARP_BYTES)

template <class F, int MT, int DEPTH>
struct RingSlot {
    static constexpr int N = DEPTH * MT * 2 * F::LOADS, M = F::SCALED ? DEPTH * MT * 2 : 0;
    static constexpr int BYTES = 32 * (16 * N + 4 * M);
    static constexpr int S = RING_WARP_BYTES / BYTES;  // stages
    static_assert(S >= 2, "a ring of at least two stages");
};

__device__ __forceinline__ void copy4_async(void* dst, const void* src, int bytes) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void ring_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void ring_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// What load_stage tests per chunk: whether its codes (ok) and its scale (s_ok, at s_col) are
// read, and which scale column they use.
template <class F>
__device__ __forceinline__ void stage_bounds(int kt, int kt1, int cols, int& col, bool& ok,
                                             int& s_col, bool& s_ok) {
    col = kt * 4 * F::CH + (threadIdx.x & 3) * F::CH;
    ok = kt < kt1 && col < cols;
    s_col = F::POST ? kt * 4 * F::CH : col;
    s_ok = F::SCALED && (F::POST ? kt < kt1 : ok);
}

// load_stage's copies into ring slot `slot` (past kt1: zeros, nothing read).
template <class F, int MT, int DEPTH>
__device__ __forceinline__ void issue_stage(char* slot, const Tiles<MT>& tl, int kt, int kt1,
                                            int cols, int shift) {
    using R = RingSlot<F, MT, DEPTH>;
    int lane = threadIdx.x & 31;
    uint4* q = (uint4*)slot;
    u32* sc = (u32*)(q + 32 * R::N);
#pragma unroll
    for (int d = 0; d < DEPTH; d++) {
        int col, s_col;
        bool ok, s_ok;
        stage_bounds<F>(kt + d, kt1, cols, col, ok, s_col, s_ok);
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int i = (d * MT + mt) * 2 + h;
                const uint4* p = (const uint4*)(tl.w[mt][h] + (ok ? F::bytes(col) : 0));
#pragma unroll
                for (int l = 0; l < F::LOADS; l++)
                    copy16_async(q + (i * F::LOADS + l) * 32 + lane, p + l, ok ? 16 : 0);
                if constexpr (F::SCALED) {
                    bool want = s_ok && (h == 0 || !F::POST);
                    const u8* b = want ? F::scale_at(tl.s[mt][h], s_col, shift) : tl.s[mt][h];
                    copy4_async(sc + i * 32 + lane, (const void*)((size_t)b & ~(size_t)3),
                                want ? 4 : 0);
                }
            }
    }
}

// Stage st from ring slot `slot` (issue_stage's copies landed): the same words and
// multipliers load_stage gives.
template <class F, int MT, int DEPTH>
__device__ __forceinline__ void read_stage(Stage<F, MT, DEPTH>& st, const char* slot,
                                           const Tiles<MT>& tl, int kt, int kt1, int cols,
                                           int shift) {
    using R = RingSlot<F, MT, DEPTH>;
    int lane = threadIdx.x & 31;
    const uint4* q = (const uint4*)slot;
    const u32* sc = (const u32*)(q + 32 * R::N);
#pragma unroll
    for (int d = 0; d < DEPTH; d++) {
        int col, s_col;
        bool ok, s_ok;
        stage_bounds<F>(kt + d, kt1, cols, col, ok, s_col, s_ok);
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int i = (d * MT + mt) * 2 + h;
#pragma unroll
                for (int l = 0; l < F::LOADS; l++)
                    st.q[d][mt][h][l] = q[(i * F::LOADS + l) * 32 + lane];
                st.mul[d][mt][h] = 0u;
                if constexpr (F::SCALED) {
                    const u8* b = F::scale_at(tl.s[mt][h], s_col, shift);
                    u32 w = sc[i * 32 + lane] >> (8 * ((size_t)b & 3));
                    if (s_ok && (h == 0 || !F::POST)) st.mul[d][mt][h] = F::mul_of(w & 0xffu);
                }
            }
    }
}

// warp_rows with the weights through a ring (issue_stage): the same stages in the same order,
// so the same sums. ring: the warp's RING_WARP_BYTES of shared memory (16-byte aligned);
// every copy has landed when it returns, so the ring can take the warp's next rows.
template <class F, int MT, int DEPTH, int NT, int XS>
__device__ __forceinline__ void ring_rows(const Tiles<MT>& tl, const XSrc& src, int kt0, int kt1,
                                          int cols, int shift, float (&v)[MT][4], char* ring) {
    using R = RingSlot<F, MT, DEPTH>;
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mt][n][i] = 0.f;
#pragma unroll
    for (int s = 0; s < R::S - 1; s++) {  // (one group a stage, empty past kt1)
        if (kt0 + s * DEPTH < kt1)
            issue_stage<F, MT, DEPTH>(ring + s * R::BYTES, tl, kt0 + s * DEPTH, kt1, cols, shift);
        ring_commit();
    }
    wait_inputs();  // the first weights are on their way before x is read (pdl.py)
    int slot = 0;
    for (int kt = kt0; kt < kt1; kt += DEPTH) {
        int ahead = kt + (R::S - 1) * DEPTH, last = slot == 0 ? R::S - 1 : slot - 1;
        if (ahead < kt1)  // into the slot read last round (its words are in registers)
            issue_stage<F, MT, DEPTH>(ring + last * R::BYTES, tl, ahead, kt1, cols, shift);
        ring_commit();
        ring_wait<R::S - 1>();  // this slot's group has landed
        Stage<F, MT, DEPTH> st;
        read_stage<F, MT, DEPTH>(st, ring + slot * R::BYTES, tl, kt, kt1, cols, shift);
        mma_stage<F, MT, DEPTH, NT, XS>(st, src, kt, kt1, cols, acc);
        slot = slot == R::S - 1 ? 0 : slot + 1;
    }
    lane_sums<MT, NT>(acc, v);
}
