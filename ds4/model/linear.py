"""y = x W^T for weights held as fp32 or as bf16 words (uint16), on either backend.

On CuPy, bf16 words go to cuBLAS GemmEx on tensor cores: the weights stay in device memory
once, in their own 16-bit form, and the fp32 activations enter as a hi + lo pair of bf16 rows
(ds4/kernels/split.cu), so the product keeps fp32-class accuracy (~1e-5 relative). Setting
DS4_GEMM=bf16 rounds the activations once instead: twice the speed of the matrix work and the
numerics of a bf16 reference run. On NumPy the words are widened (exact) and multiplied in fp32.
"""

from __future__ import annotations

import os

import numpy as np

from ds4.kernels import widen

CUDA_R_32F, CUDA_R_16BF, CUBLAS_COMPUTE_32F = 0, 14, 68
ONE, ZERO = np.array(1.0, np.float32), np.array(0.0, np.float32)  # host scalars cuBLAS reads


def split_inputs() -> bool:
    """True unless DS4_GEMM=bf16 asks for one bf16 rounding of the activations."""
    return os.environ.get("DS4_GEMM", "bf16x2") != "bf16"


def linear(xp, x, w):
    """x [..., K] times w [N, K] transposed -> [..., N] in fp32."""
    if w.dtype != xp.uint16:
        return x @ w.T
    if xp is np:
        return x @ widen(w).T
    lead = x.shape[:-1]
    y = batched_linear(xp, x.reshape(1, -1, x.shape[-1]), w.reshape(1, *w.shape))
    return y.reshape(*lead, w.shape[0])


def batched_linear(xp, x, w):
    """x [B, M, K] times each w[b] [N, K] transposed -> [B, M, N] in fp32 (one cuBLAS call)."""
    if w.dtype != xp.uint16:
        return xp.matmul(x, w.transpose(0, 2, 1))
    if xp is np:
        return np.matmul(x, widen(w).transpose(0, 2, 1))
    return _gemm_words(xp, xp.ascontiguousarray(x, dtype=xp.float32), xp.ascontiguousarray(w))


def _gemm_words(cp, x, w):
    from cupy.cuda import cublas

    from ds4.kernels.split import split_bf16

    B, M, K = x.shape
    N = w.shape[1]
    if split_inputs():
        rows = 2 * M
        words = split_bf16(x, cp.empty((B, rows, K), cp.uint16))
    else:
        rows = M
        words = _round_bf16(cp, x)
    y = cp.empty((B, rows, N), cp.float32)
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    # Row-major y[b] = x[b] w[b]^T is column-major y^T = w x^T: A = w (transposed), B = x.
    cublas.gemmStridedBatchedEx(
        handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, N, rows, K,
        ONE.ctypes.data, w.data.ptr, CUDA_R_16BF, K, N * K if w.shape[0] > 1 else 0,
        words.data.ptr, CUDA_R_16BF, K, rows * K,
        ZERO.ctypes.data, y.data.ptr, CUDA_R_32F, N, rows * N,
        B, CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    return y[:, :M] + y[:, M:] if rows > M else y


def _round_bf16(cp, x):
    bits = x.view(cp.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cp.uint16)
