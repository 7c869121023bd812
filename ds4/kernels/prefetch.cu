// l2_prefetch: ask the L2 for a weight range a later kernel of the step reads, issued on a side
// branch of the decode graph while the main chain runs latency-bound kernels (DRAM idle). The
// requests return nothing to the SM, so the kernel ends once they are issued; no value changes.
#include "common.cuh"

// Each thread asks for 128-byte lines, grid-stride; evict_last keeps them until their reader.
extern "C" __global__ void l2_prefetch_lines(const char* __restrict__ base, long long bytes,
                                          int last) {
    long long step = (long long)gridDim.x * blockDim.x * 128;
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 128;
    for (; i < bytes; i += step) {
        if (last)
            asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(base + i));
        else
            asm volatile("prefetch.global.L2 [%0];" ::"l"(base + i));
    }
}

// Each thread asks for `chunk` bytes at a time through the copy engine's bulk prefetch (sm_90;
// chunk a multiple of 16, the range 16-byte aligned: a tail under 16 bytes is not asked for).
extern "C" __global__ void l2_prefetch_bulk(const char* __restrict__ base, long long bytes,
                                         int chunk) {
#if __CUDA_ARCH__ >= 900
    long long step = (long long)gridDim.x * blockDim.x * chunk;
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * chunk;
    for (; i < bytes; i += step) {
        int n = (int)min((long long)chunk, bytes - i) & ~15;
        if (n > 0)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + i), "r"(n)
                         : "memory");
    }
#endif
}
