"""y = x W^T for weights held as fp32 or as bf16 words (uint16), on either backend.

On CuPy, bf16 words go to cuBLAS GemmEx on tensor cores: the weights stay in device memory
once, in their own 16-bit form, and the fp32 activations enter as a hi + lo pair of bf16 rows
(ds4/kernels/split.cu), so the product keeps fp32-class accuracy (~1e-5 relative). DS4_GEMM=bf16
rounds the activations once instead (~3e-3 relative, what bf16 engines do): half the GEMM work,
see docs/PERF.md for what it buys. On NumPy the words are widened (exact) and multiplied in fp32.
"""

from __future__ import annotations

import os

import numpy as np

from ds4.kernels import widen
from ds4.model.packed import is_packed

CUDA_R_32F, CUDA_R_16BF, CUBLAS_COMPUTE_32F = 0, 14, 68
ONE, ZERO = np.array(1.0, np.float32), np.array(0.0, np.float32)  # host scalars cuBLAS reads


def parts() -> int:
    """bf16 words per activation: 2 (hi + lo, the default) or 1 with DS4_GEMM=bf16."""
    return 1 if os.environ.get("DS4_GEMM", "bf16x2") == "bf16" else 2


def held(xp, w):
    """w as an array the products read: a packed matrix widened now into the engine's scratch
    (fp32 on NumPy, exact bf16 words for the GPU's GEMMs); other weights as they are."""
    if not is_packed(w):
        return w
    return w.dense(xp) if xp is np else w.words(xp)


def linear(xp, x, w):
    """x [..., K] times w [N, K] transposed -> [..., N] in fp32 (packed w widened per use)."""
    w = held(xp, w)
    if w.dtype != xp.uint16:
        return x @ w.T
    if xp is np:
        return _words_product(x, w)
    lead = x.shape[:-1]
    y = batched_linear(xp, x.reshape(1, -1, x.shape[-1]), w.reshape(1, *w.shape))
    return y.reshape(*lead, w.shape[0])


TILE_VALUES = 1 << 18  # weights widened at a time on NumPy (1 MiB of fp32: stays in cache)


def _words_product(x, w):
    """x @ w^T on NumPy for bf16 words w, widened one cache-sized band of rows at a time (a
    mapped head or embedding is never widened as a whole)."""
    rows, K = w.shape
    band = max(1, TILE_VALUES // K)
    if rows <= band:
        return x @ widen(w).T
    out = np.empty((*x.shape[:-1], rows), np.float32)
    buf = np.empty((band, K), np.uint32)
    for r in range(0, rows, band):
        part = w[r:r + band]
        bits = buf[: part.shape[0]]
        np.left_shift(part, 16, out=bits, dtype=np.uint32)
        out[..., r:r + part.shape[0]] = x @ bits.view(np.float32).T
    return out


def batched_linear(xp, x, w):
    """x [B, M, K] times each w[b] [N, K] transposed -> [B, M, N] in fp32 (one cuBLAS call)."""
    if w.dtype != xp.uint16:
        return xp.matmul(x, w.transpose(0, 2, 1))
    if xp is np:
        return np.matmul(x, widen(w).transpose(0, 2, 1))
    B, M, K = x.shape
    N = w.shape[1]
    words = _words(xp, x.reshape(B * M, K))  # [B*M, p, K]: row r's hi (and lo)
    p = words.shape[1]
    y = xp.empty((B * M, p, N), xp.float32)
    _gemm(xp, w, words, y, N, p * M, K, batch=B, w_stride=N * K if w.shape[0] > 1 else 0)
    return _join(y).reshape(B, M, N)


def grouped_linear(xp, x, w, groups: list[tuple[int, int, int]]):
    """y[start:end] = x[start:end] w[g]^T for each (g, start, end): one cuBLAS call per group."""
    R, K = x.shape
    N = w.shape[1]
    if xp is np or (not is_packed(w) and w.dtype != xp.uint16):
        y = xp.empty((R, N), xp.float32)
        for g, start, end in groups:
            y[start:end] = x[start:end] @ widen(held(xp, w[g]), xp).T
        return y
    words = _words(xp, x)
    p = words.shape[1]
    y = xp.empty((R, p, N), xp.float32)
    for g, start, end in groups:  # a packed expert is widened to bf16 words just before its GEMM
        _gemm(xp, held(xp, w[g]), words[start:], y[start:], N, p * (end - start), K)
    return _join(y)


def _words(cp, x):
    """x [R, K] fp32 -> [R, p, K] bf16 words: each row's rounding (hi), then its
    remainder's (lo)."""
    from ds4.kernels.split import split_bf16

    x = cp.ascontiguousarray(x, dtype=cp.float32).reshape(x.shape[0], 1, -1)
    return split_bf16(x, cp.empty((x.shape[0], parts(), x.shape[2]), cp.uint16))


def _join(y):
    """[R, p, N] products of the hi (and lo) rows -> [R, N]."""
    return y[:, 0] + y[:, 1] if y.shape[1] == 2 else y[:, 0]


def _gemm(cp, w, words, y, N: int, rows: int, K: int, batch: int = 1, w_stride: int = 0) -> None:
    """y[b] (rows x N, fp32) = words[b] (rows x K, bf16) times w[b] (N x K, bf16) transposed."""
    from cupy.cuda import cublas

    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    # Row-major y = x w^T is column-major y^T = w x^T: A = w (transposed), B = x.
    cublas.gemmStridedBatchedEx(
        handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, N, rows, K,
        ONE.ctypes.data, w.data.ptr, CUDA_R_16BF, K, w_stride,
        words.data.ptr, CUDA_R_16BF, K, rows * K,
        ZERO.ctypes.data, y.data.ptr, CUDA_R_32F, N, rows * N,
        batch, CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
