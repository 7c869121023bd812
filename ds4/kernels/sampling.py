"""Device selection launchers (ds4/kernels/sampling.cu) and their NumPy twins."""

from __future__ import annotations

import numpy as np

from ds4.kernels import NULL, i32, launch, ptr


def argmax(x, out):
    """out[0] = the index of the largest x (lowest index on ties); x [B, n] (rows contiguous):
    out[b] per row, one launch."""
    rows, ld = (1, 0) if x.ndim == 1 else (x.shape[0], x.strides[0] // x.itemsize)
    assert x.strides[-1] == x.itemsize
    launch("sampling", "argmax", (rows,), (1024,),
           (ptr(x), i32(x.shape[-1]), ptr(out), np.int64(ld)))
    return out


def argmax_numpy(x, out):
    """NumPy twin of argmax."""
    x = np.asarray(x)
    out[: 1 if x.ndim == 1 else x.shape[0]] = np.argmax(x.reshape(-1, x.shape[-1]), axis=1)
    return out


def topk_select(x, k: int, sel, sel_count, pos=None, ratio: int = 1, n: int | None = None):
    """sel[0:count] = indices (ascending) of the k largest of x[0:n], n = (pos[0]+1)//ratio
    when pos is given; ties at the threshold keep the lower indices. x [B, S] (sel [B, k],
    sel_count and pos [B]): each row on its own."""
    n_fixed = x.shape[-1] if n is None else n
    batch = 1 if x.ndim == 1 else x.shape[0]  # x [B, S], sel [B, k], sel_count, pos [B]
    assert batch == 1 or sel.shape[-1] == k
    args = (ptr(x), NULL if pos is None else ptr(pos), i32(ratio), i32(n_fixed), i32(k),
            ptr(sel), ptr(sel_count), i32(x.shape[-1]))
    launch("sampling", "topk_select", (1, 1, batch), (1024,), args)
    return sel


def topk_select_numpy(x, k: int, sel, sel_count, pos=None, ratio: int = 1, n: int | None = None):
    """NumPy twin of topk_select."""
    if np.ndim(x) == 2:
        for b in range(x.shape[0]):
            topk_select_numpy(x[b], k, sel[b], sel_count[b:b + 1],
                              None if pos is None else pos[b:b + 1], ratio, n)
        return sel
    count = (int(np.asarray(pos)[0]) + 1) // ratio if pos is not None else (
        x.shape[0] if n is None else n)
    order = np.lexsort((np.arange(count), -np.asarray(x[:count], dtype=np.float64)))
    chosen = np.sort(order[:min(k, count)])
    sel[:len(chosen)] = chosen
    sel_count[0] = len(chosen)
    return sel
