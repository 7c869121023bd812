"""fp32 rows as bf16 hi/lo words for the tensor-core GEMMs (ds4/kernels/split.cu), and a twin."""

from __future__ import annotations

import numpy as np

from ds4.kernels import i32, launch, ptr, to_bf16, widen

THREADS = 256


def split_bf16(x, out):
    """out [G, pR, K] words per group of x [G, R, K]: round(x) rows, then (p = 2)
    round(x - round(x))."""
    groups = x.shape[0]
    n = x.size
    blocks = min(max(1, (n + THREADS - 1) // THREADS), 65535)
    launch("split", "split_bf16", (blocks,), (THREADS,),
           (ptr(x), ptr(out), np.int64(n // groups), np.int64(n), i32(out.shape[1] // x.shape[1])))
    return out


def split_bf16_numpy(x, out):
    """NumPy twin of split_bf16."""
    rows = x.shape[1]
    hi = to_bf16(x)
    out[:, :rows] = hi
    if out.shape[1] == 2 * rows:
        out[:, rows:] = to_bf16(np.asarray(x, np.float32) - widen(hi))
    return out
