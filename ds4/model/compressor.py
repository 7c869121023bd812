"""KV compressor (docs/MODEL.md, Compressors): windows at absolute positions, softmax pooling."""

from __future__ import annotations

import numpy as np

from ds4.model.hyper_connection import rms_norm
from ds4.model.linear import linear
from ds4.model.state import CompressorState


def softmax_pool(xp, kv, score, axis: int):
    """Per-channel softmax of score over `axis`, weighted sum of kv (fp32)."""
    score = score - score.max(axis=axis, keepdims=True)
    weight = xp.exp(score)
    return (weight * kv).sum(axis=axis) / weight.sum(axis=axis)


def pool_windows(xp, comp: CompressorState, kv, score, start: int):
    """Feed rows of positions start.. into comp; return (pooled [nw, out], first window index).

    Rows of an unfinished window wait in the pending buffer; a CSA window also pools the
    previous window's first half (the overlap), carried across calls in comp.overlap_*.
    """
    m = comp.ratio
    held = start % m
    if held:
        kv = xp.concatenate([comp.pending_kv[:held], kv])
        score = xp.concatenate([comp.pending_score[:held], score])
    nw = kv.shape[0] // m
    done = nw * m
    rest = kv.shape[0] - done
    pooled = None
    if nw:
        win_kv = kv[:done].reshape(nw, m, -1)
        win_score = score[:done].reshape(nw, m, -1)
        if xp is not np and nw < 65536:  # one kernel for every window, not ~20 array ops
            pooled = _pool_kernel(xp, comp, win_kv, win_score)
        elif comp.overlap:
            pooled = _pool_overlap(xp, comp, win_kv, win_score)
        else:
            pooled = softmax_pool(xp, win_kv, win_score, axis=1)
    if rest:
        comp.pending_kv[:rest] = kv[done:]
        comp.pending_score[:rest] = score[done:]
    return pooled, (start - held) // m


def _pool_overlap(xp, comp: CompressorState, win_kv, win_score):
    """CSA: entry w pools window w-1's A-half with window w's B-half (8 slots per channel)."""
    half = win_kv.shape[-1] // 2
    prev_kv = xp.concatenate([comp.overlap_kv[None], win_kv[:-1, :, :half]])
    prev_score = xp.concatenate([comp.overlap_score[None], win_score[:-1, :, :half]])
    slots_kv = xp.concatenate([prev_kv, win_kv[:, :, half:]], axis=1)
    slots_score = xp.concatenate([prev_score, win_score[:, :, half:]], axis=1)
    comp.overlap_kv[...] = win_kv[-1, :, :half]
    comp.overlap_score[...] = win_score[-1, :, :half]
    return softmax_pool(xp, slots_kv, slots_score, axis=1)


def _pool_kernel(xp, comp: CompressorState, win_kv, win_score):
    """`_pool_overlap` / `softmax_pool` of the windows in one launch (ds4/kernels/compressor.cu),
    then the last window's A-half carried as the overlap."""
    from ds4.kernels.compressor import compressor_pool_windows

    win_kv = xp.ascontiguousarray(win_kv, dtype=xp.float32)
    win_score = xp.ascontiguousarray(win_score, dtype=xp.float32)
    hd = win_kv.shape[-1] // 2 if comp.overlap else win_kv.shape[-1]
    carried = (comp.overlap_kv, comp.overlap_score) if comp.overlap else (None, None)
    pooled = compressor_pool_windows(win_kv, win_score, *carried,
                                     xp.empty((win_kv.shape[0], hd), xp.float32))
    if comp.overlap:  # after the launch on the same stream: window 0 read the old overlap
        comp.overlap_kv[...] = win_kv[-1, :, :hd]
        comp.overlap_score[...] = win_score[-1, :, :hd]
    return pooled


def compress(xp, weights, comp: CompressorState, h, positions, start: int, rope, eps: float,
             finish=None) -> int:
    """Project h [S, D], pool closed windows, norm + rope at the window start, append rows.

    `weights(name)` reads the compressor's tensors; `finish(rows)` is the optional FP8/FP4
    simulation applied after RoPE. Returns the number of valid compressed rows afterwards.
    """
    m = comp.ratio
    kv = linear(xp, h, weights("kv_proj.weight"))
    score = linear(xp, h, weights("gate_proj.weight")) + weights("position_bias")[positions % m]
    pooled, first = pool_windows(xp, comp, kv, score, start)
    if pooled is not None:
        rows = rms_norm(xp, pooled, weights("kv_norm.weight"), eps)
        window_starts = (xp.arange(pooled.shape[0]) + first) * m
        cos, sin = rope.cos_sin(window_starts)
        rows = rope.rotate(rows, cos, sin)
        if finish is not None:
            rows = finish(rows)
        comp.rows[first : first + rows.shape[0]] = rows
    return (start + h.shape[0]) // m
