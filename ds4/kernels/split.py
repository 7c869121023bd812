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
    parts = i32(out.shape[1] // x.shape[1])
    aligned = x.data.ptr % 16 == 0 and out.data.ptr % 8 == 0
    if (n // groups) % 4 == 0 and n // 4 < 2**31 and aligned:  # whole quads (the usual case)
        quads = n // 4
        blocks = min(max(1, -(-quads // THREADS)), 132 * 16)
        launch("split", "split_bf16_quads", (blocks,), (THREADS,),
               (ptr(x), ptr(out), np.uint32(quads // groups), np.uint32(quads), parts))
        return out
    blocks = min(max(1, (n + THREADS - 1) // THREADS), 65535)
    launch("split", "split_bf16", (blocks,), (THREADS,),
           (ptr(x), ptr(out), np.int64(n // groups), np.int64(n), parts))
    return out


def split_bf16_numpy(x, out):
    """NumPy twin of split_bf16."""
    rows = x.shape[1]
    hi = to_bf16(x)
    out[:, :rows] = hi
    if out.shape[1] == 2 * rows:
        out[:, rows:] = to_bf16(np.asarray(x, np.float32) - widen(hi))
    return out
