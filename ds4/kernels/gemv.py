"""bf16-weight GEMV launchers (ds4/kernels/gemv.cu) and their NumPy twins."""

from __future__ import annotations

import numpy as np

from ds4.kernels import i32, launch, ptr, widen

WARPS_PER_BLOCK = 8
TARGET_WARPS = 4096  # rows x splits; more splits only add atomics (measured on the H200)
MIN_SPAN = 512  # columns per warp: below this a warp has too few loads in flight


def pick_splits(rows: int, cols: int) -> int:
    """Column splits so short matrices still fill the GPU; each span >= MIN_SPAN columns."""
    splits = 1
    while rows * splits < TARGET_WARPS and cols % (2 * splits * MIN_SPAN) == 0:
        splits *= 2
    return splits


def weight_kind(w) -> str:
    """Kernel name suffix for a weight array: bf16 words (uint16) or fp32."""
    if w.dtype == np.uint16:
        return "bf16"
    assert w.dtype == np.float32, w.dtype
    return "f32"


def pick_rows_per_warp(rows: int, cols: int, splits: int) -> int:
    """2 rows per warp for tall matrices (more loads in flight per warp), else 1: on the H200
    it won for 8192x4096 (3.26 vs 2.91 TB/s) and lost for 4096x8192 (2.48 vs 3.07)."""
    return 2 if splits == 1 and rows >= 2 * TARGET_WARPS else 1


def gemv(w, x, out, rows_per_group: int | None = None, splits: int | None = None,
         rows_per_warp: int | None = None):
    """out = W x (W [rows, cols] bf16 words or fp32); row r reads
    x[(r // rows_per_group) * cols:]."""
    rows, cols = w.shape
    assert cols % 8 == 0 and w.flags.c_contiguous
    group = rows if rows_per_group is None else rows_per_group
    splits = pick_splits(rows, cols) if splits is None else splits
    per_warp = pick_rows_per_warp(rows, cols, splits) if rows_per_warp is None else rows_per_warp
    threads = 32 * WARPS_PER_BLOCK
    if per_warp == 2:
        grid = ((rows + 2 * WARPS_PER_BLOCK - 1) // (2 * WARPS_PER_BLOCK),)
        args = (ptr(w), ptr(x), ptr(out), i32(rows), i32(cols), i32(group))
        launch("gemv", "gemv2_" + weight_kind(w), grid, (threads,), args)
        return out
    if splits > 1:
        out.fill(0)
    grid = ((rows + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, splits)
    args = (ptr(w), ptr(x), ptr(out), i32(rows), i32(cols), i32(group), i32(splits))
    launch("gemv", "gemv_" + weight_kind(w), grid, (threads,), args)
    return out


def gemv_numpy(w, x, out, rows_per_group: int | None = None, splits: int | None = None,
               rows_per_warp: int | None = None):
    """NumPy twin of gemv."""
    rows, cols = w.shape
    group = rows if rows_per_group is None else rows_per_group
    wf = widen(w).reshape(rows // group, group, cols)
    xs = np.asarray(x, dtype=np.float32).reshape(rows // group, cols)
    out[...] = np.einsum("grc,gc->gr", wf, xs).reshape(rows)
    return out


def gemv_table(xp, weights: list, outs: list):
    """The device table gemv_many reads: (W pointer, y pointer, rows) per matrix."""
    rows = [w.shape[0] for w in weights]
    return xp.asarray(np.array([[int(ptr(w)), int(ptr(y)), r]
                                for w, y, r in zip(weights, outs, rows)],
                               dtype=np.int64).reshape(-1))


def gemv_many(table, weights: list, x, outs: list):
    """outs[k] = weights[k] x for matrices of one dtype and column count, in one launch.
    table: gemv_table(xp, weights, outs), built once (it holds their addresses)."""
    cols, total = weights[0].shape[1], sum(w.shape[0] for w in weights)
    assert cols % 8 == 0 and all(w.shape[1] == cols and w.dtype == weights[0].dtype
                                 for w in weights)
    grid = ((total + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK,)
    launch("gemv", "gemv_many_" + weight_kind(weights[0]), grid, (32 * WARPS_PER_BLOCK,),
           (ptr(table), i32(len(weights)), ptr(x), i32(cols)))
    return outs


def gemv_many_numpy(table, weights: list, x, outs: list):
    """NumPy twin of gemv_many (the table is unused)."""
    for w, y in zip(weights, outs):
        y[...] = widen(w) @ x
    return outs
