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
    """x [B, M, K] times each w[b] [N, K] transposed -> [B, M, N] in fp32 (cuBLAS, batched)."""
    if w.dtype != xp.uint16:
        return xp.matmul(x, w.transpose(0, 2, 1))
    if xp is np:
        return np.matmul(x, widen(w).transpose(0, 2, 1))
    B, M, K = x.shape
    N = w.shape[1]
    words = _words(xp, x.reshape(B * M, K))  # [B*M, p, K]: row r's hi (and lo)
    y = xp.empty((B, M, N), xp.float32)
    w_stride = N * K if w.shape[0] > 1 else 0
    _gemm_parts(xp, w, w_stride, words, words.shape[1] * K, M * words.shape[1] * K, y, N, M * N,
                (N, M, K, B))
    return y


def grouped_rows_linear(xp, x, w):
    """x [S, G, K] row group g of each row times its own w[g] [N, K] transposed -> [S, G, N].

    On CuPy the cuBLAS batches stride over x's and y's middle axis in place, so neither side
    is transposed into a copy (at a 2048-token prefill chunk, V4's o_a input is 268 MB)."""
    if xp is np or w.dtype != xp.uint16:
        y = batched_linear(xp, x.transpose(1, 0, 2), w)
        return y.transpose(1, 0, 2)
    S, G, K = x.shape
    N = w.shape[1]
    words = _words(xp, x.reshape(S * G, K))  # [S*G, p, K]
    p = words.shape[1]
    y = xp.empty((S, G, N), xp.float32)
    _gemm_parts(xp, w, N * K, words, G * p * K, p * K, y, G * N, N, (N, S, K, G))
    return y


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
    y = xp.empty((R, N), xp.float32)
    for g, start, end in groups:  # a packed expert is widened to bf16 words just before its GEMM
        _gemm_parts(xp, held(xp, w[g]), 0, words[start:], p * K, 0, y[start:], N, 0,
                    (N, end - start, K, 1))
    return y


def _words(cp, x):
    """x [R, K] fp32 -> [R, p, K] bf16 words: each row's rounding (hi), then its
    remainder's (lo)."""
    from ds4.kernels.split import split_bf16

    x = cp.ascontiguousarray(x, dtype=cp.float32).reshape(x.shape[0], 1, -1)
    return split_bf16(x, cp.empty((x.shape[0], parts(), x.shape[2]), cp.uint16))


def _gemm_parts(cp, w, w_stride: int, words, ldb: int, b_stride: int, y, ldc: int,
                c_stride: int, dims: tuple[int, int, int, int]) -> None:
    """y = words' hi rows times w transposed, then + the lo rows' product (p = 2) accumulated
    by the second GEMM into the same y (beta = 1): no [rows, 2, N] product and no pass adding
    its halves. dims = (N, rows, K, batch); ldb / ldc and the strides are in elements."""
    for part in range(words.shape[1]):
        _gemm(cp, w, w_stride, words[:, part], ldb, b_stride, y, ldc, c_stride, dims,
              ONE if part else ZERO)


def _gemm(cp, w, w_stride: int, words, ldb: int, b_stride: int, y, ldc: int, c_stride: int,
          dims: tuple[int, int, int, int], beta) -> None:
    """y[b] (rows x N, fp32, row stride ldc) = words[b] (rows x K bf16, row stride ldb) times
    w[b] (N x K bf16) transposed, + beta y[b]; batch b steps w, words and y by their strides."""
    from cupy.cuda import cublas

    N, rows, K, batch = dims
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    # Row-major y = x w^T is column-major y^T = w x^T: A = w (transposed), B = x.
    cublas.gemmStridedBatchedEx(
        handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, N, rows, K,
        ONE.ctypes.data, w.data.ptr, CUDA_R_16BF, K, w_stride,
        words.data.ptr, CUDA_R_16BF, ldb, b_stride,
        beta.ctypes.data, y.data.ptr, CUDA_R_32F, ldc, c_stride,
        batch, CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
