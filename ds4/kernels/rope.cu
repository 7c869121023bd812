// RoPE on a row's last `rope_dim` channels, interleaved pairs (docs/MODEL.md, Attention): pair k of
// row r turns by angle sign * pos * freqs[k]. The angle is formed in float64 (as the NumPy engine
// does; fp32 angles drift at long positions), then cos/sin are rounded to fp32.

#include "common.cuh"

// x is [rows, width]; row r uses position pos[r / rows_per_pos] + pos_offset. sign -1 undoes it
// (the attention output's inverse rotation).
extern "C" __global__ void rope_tail(float* x, const int* __restrict__ pos,
                                     const double* __restrict__ freqs, int rows, int width,
                                     int rope_dim, int rows_per_pos, int pos_offset, float sign) {
    wait_inputs();  // (pdl.py)
    int half = rope_dim >> 1;
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows * half) return;
    int r = t / half, k = t % half;
    double ds, dc;
    sincos((double)(pos[r / rows_per_pos] + pos_offset) * freqs[k], &ds, &dc);
    float s = (float)ds * sign, c = (float)dc;
    float* p = x + (size_t)r * width + (width - rope_dim) + 2 * k;
    float a = p[0], b = p[1];
    p[0] = a * c - b * s;
    p[1] = a * s + b * c;
}

// Prefill's rotation (ds4/model/rope.py, Rope.rotate) by tables already formed: x is [rows, mid,
// width] with row stride rs and mid stride ms (floats; channels contiguous), and pair k of the
// trailing rope_dim channels of row r turns by cos/sin [rows, rope_dim/2] (sign -1 undoes it).
// Every product and sum is rounded on its own (no FMA contraction), as the array operations
// this one launch replaces round them: the same bits.
extern "C" __global__ void rope_rows(float* x, long long rs, long long ms, int rows, int mid,
                                     int width, int rope_dim, const float* __restrict__ cos,
                                     const float* __restrict__ sin, float sign) {
    wait_inputs();  // (pdl.py)
    int half = rope_dim >> 1;
    long long n = (long long)rows * mid * half;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < n;
         t += (long long)gridDim.x * blockDim.x) {
        int k = (int)(t % half);
        long long rm = t / half, r = rm / mid;
        int m = (int)(rm - r * mid);
        float c = cos[r * half + k], s = sin[r * half + k] * sign;
        float* p = x + r * rs + m * ms + (width - rope_dim) + 2 * k;
        float a = p[0], b = p[1];
        p[0] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        p[1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
}
