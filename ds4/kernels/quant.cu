// The official graph's own rounding inside the decode step (docs/PERF.md): FP8 E4M3 round trip
// of a KV row's non-rope channels, and Hadamard rotation + FP4 E2M1 round trip of indexer rows.
// Which row a step rounds is read from device memory (pos), so a captured graph stays valid.

#include "common.cuh"

// Nearest value of a small float format (ties to even), saturating at max_value: the same
// float32 operations as ds4/model/quant.py's _round_float.
__device__ __forceinline__ float round_small(float x, int mant_bits, int min_exp, float max_value) {
    float mag = fminf(fabsf(x), max_value);
    int e;
    frexpf(mag, &e);
    e = max(e - 1, min_exp);
    float step = ldexpf(1.f, e - mant_bits);
    return copysignf(fminf(rintf(mag / step) * step, max_value), x);
}

// Row `row` of rows [*, width] (row < 0: nothing), channels [0, n) in blocks of `block`: each
// block scaled by 2^ceil(log2(max(amax, floor) / max_value)) and rounded. One thread per
// channel; values staged in shared memory so each thread can scan its block's magnitudes.
__device__ void round_blocks(float* rows, int row, int width, int n, int block, int mant_bits,
                             int min_exp, float max_value, float floor_amax) {
    extern __shared__ float vals[];
    if (row < 0) return;
    float* r = rows + (size_t)row * width;
    int c = threadIdx.x;
    if (c < n) vals[c] = r[c];
    __syncthreads();
    if (c >= n) return;
    int b0 = c / block * block;
    float amax = floor_amax;
    for (int i = b0; i < min(b0 + block, n); i++) amax = fmaxf(amax, fabsf(vals[i]));
    float scale = exp2f(ceilf(log2f(amax / max_value)));
    r[c] = round_small(vals[c] / scale, mant_bits, min_exp, max_value) * scale;
}

__device__ __forceinline__ int closed_row(const int* pos, int ratio) {
    int t = pos[0] + 1;
    return t % ratio ? -1 : t / ratio - 1;
}

// KV FP8 round trip (official KV storage): block of 64 channels, amax floor 1e-4, +-448.
// kv_fp8_slot: the raw ring row of token pos (pos % cap). kv_fp8_closed: the compressed row
// that token pos closes (none unless (pos + 1) % ratio == 0).
extern "C" __global__ void kv_fp8_slot(float* rows, int width, int nope, int block,
                                       const int* pos, int cap) {
    wait_inputs();  // (pdl.py)
    round_blocks(rows, pos[0] % cap, width, nope, block, 3, -6, 448.f, 1e-4f);
}

// kv_fp8_rows: every row of rows (one block a row): prefill's KV rows, a chunk at a time.
extern "C" __global__ void kv_fp8_rows(float* rows, int width, int nope, int block) {
    wait_inputs();  // (pdl.py)
    round_blocks(rows, (int)blockIdx.x, width, nope, block, 3, -6, 448.f, 1e-4f);
}

extern "C" __global__ void kv_fp8_closed(float* rows, int width, int nope, int block,
                                         const int* pos, int ratio) {
    wait_inputs();  // (pdl.py)
    round_blocks(rows, closed_row(pos, ratio), width, nope, block, 3, -6, 448.f, 1e-4f);
}

// Indexer QAT: rows <- FP4 round trip (blocks of `block`, amax floor 1e-30, +-6) of
// rows H / sqrt(n) (Sylvester Hadamard, n = width, a power of two <= 1024). One block per
// row: all rows of `rows` (ratio 0) or only the compressed row token pos closes.
__device__ __forceinline__ void hadamard_row(float* rows, int row, int width, int block,
                                             float norm) {
    extern __shared__ float vals[];
    if (row < 0) return;
    float* r = rows + (size_t)row * width;
    int c = threadIdx.x;
    if (c < width) vals[c] = r[c];
    __syncthreads();
    for (int h = 1; h < width; h <<= 1) {  // in-place fast Walsh-Hadamard transform
        float a = 0.f, b = 0.f;
        bool lead = c < width && (c & h) == 0;
        if (lead) { a = vals[c]; b = vals[c + h]; }
        __syncthreads();
        if (lead) { vals[c] = a + b; vals[c + h] = a - b; }
        __syncthreads();
    }
    if (c < width) r[c] = vals[c] * norm;  // norm = float32(1 / sqrt(width))
    __syncthreads();
    round_blocks(rows, row, width, width, block, 1, 0, 6.f, 1e-30f);
}

extern "C" __global__ void hadamard_fp4(float* rows, int width, int block, float norm,
                                        const int* pos, int ratio) {
    wait_inputs();  // (pdl.py)
    hadamard_row(rows, ratio ? closed_row(pos, ratio) : (int)blockIdx.x, width, block, norm);
}

// Member b = blockIdx.z of a batch graph (see attention.cu): its rows' address is ptrs[b], its
// position positions[b]. kv_fp8_slot_m / kv_fp8_closed_m / hadamard_fp4_m (closed row only).
extern "C" __global__ void kv_fp8_slot_m(const long long* __restrict__ ptrs, int width, int nope,
                                         int block, const int* positions, int cap) {
    wait_inputs();  // (pdl.py)
    int b = blockIdx.z;
    round_blocks((float*)ptrs[b], positions[b] % cap, width, nope, block, 3, -6, 448.f, 1e-4f);
}

extern "C" __global__ void kv_fp8_closed_m(const long long* __restrict__ ptrs, int width,
                                           int nope, int block, const int* positions,
                                           int ratio) {
    wait_inputs();  // (pdl.py)
    int b = blockIdx.z;
    round_blocks((float*)ptrs[b], closed_row(positions + b, ratio), width, nope, block, 3, -6,
                 448.f, 1e-4f);
}

extern "C" __global__ void hadamard_fp4_m(const long long* __restrict__ ptrs, int width,
                                          int block, float norm, const int* positions,
                                          int ratio) {
    wait_inputs();  // (pdl.py)
    int b = blockIdx.z;
    hadamard_row((float*)ptrs[b], closed_row(positions + b, ratio), width, block, norm);
}
