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
