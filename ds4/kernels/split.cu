// fp32 activations as two bf16 words each (hi + lo), the inputs of the tensor-core GEMMs.
//
// x = hi + lo + r with |r| <= 2^-16 |x|, so one bf16 GEMM over the stacked [hi; lo] rows with
// fp32 accumulation gives W x to ~1e-5 relative: fp32-class results at tensor-core speed,
// where one bf16 rounding of x alone (parts = 1: hi only) costs ~3e-3 but half the GEMM work.

#include "common.cuh"

__device__ __forceinline__ unsigned short round_bf16(float v) {
    unsigned int b = __float_as_uint(v);
    return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);  // nearest, ties to even
}

// x is [groups, rows, k] fp32; out is [groups, parts * rows, k] bf16 words: each group's rows
// rounded (hi), then, when parts == 2, their remainders rounded (lo). group_size = rows * k.
extern "C" __global__ void split_bf16(const float* __restrict__ x, unsigned short* __restrict__ out,
                                      long long group_size, long long n, int parts) {
    wait_inputs();  // (pdl.py)
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long g = i / group_size, r = i - g * group_size;
        float v = x[i];
        unsigned short hi = round_bf16(v);
        out[parts * g * group_size + r] = hi;
        if (parts == 2) out[(2 * g + 1) * group_size + r] = round_bf16(v - widen(hi));
    }
}

// The same for group sizes that are a multiple of 4 (every model width): four values a thread,
// one 16-byte load and one 8-byte store per part, and one 32-bit division per four values where
// split_bf16 pays a 64-bit one per value (what made it ~5x its bytes). quads = n / 4 < 2^31.
extern "C" __global__ void split_bf16_quads(const float4* __restrict__ x, ushort4* __restrict__ out,
                                            unsigned group_quads, unsigned quads, int parts) {
    wait_inputs();  // (pdl.py)
    unsigned stride = gridDim.x * blockDim.x;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < quads; i += stride) {
        unsigned g = i / group_quads, r = i - g * group_quads;
        float4 v = x[i];
        ushort4 hi =
            make_ushort4(round_bf16(v.x), round_bf16(v.y), round_bf16(v.z), round_bf16(v.w));
        long long base = (long long)parts * g * group_quads + r;
        out[base] = hi;
        if (parts == 2)
            out[base + group_quads] = make_ushort4(
                round_bf16(v.x - widen(hi.x)), round_bf16(v.y - widen(hi.y)),
                round_bf16(v.z - widen(hi.z)), round_bf16(v.w - widen(hi.w)));
    }
}
