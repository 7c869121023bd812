"""KV-compressor launchers (ds4/kernels/compressor.cu) and their NumPy twins."""

from __future__ import annotations

import numpy as np

from ds4.kernels import f32, i32, launch, ptr
from ds4.kernels.norm import rms_norm_numpy
from ds4.kernels.rope import rope_angles_numpy, rotate_numpy


def compressor_push(kvp, g, bias, pos, state_kv, state_score, ratio: int, overlap: bool):
    """Write token pos's projected kv and gate + bias[pos % ratio] into the open window."""
    cw = state_kv.shape[1]
    args = (ptr(kvp), ptr(g), ptr(bias), ptr(pos), ptr(state_kv), ptr(state_score),
            i32(ratio), i32(cw), i32(int(overlap)))
    launch("compressor", "compressor_push", ((cw + 255) // 256,), (256,), args)
    return state_kv


def compressor_push_numpy(kvp, g, bias, pos, state_kv, state_score, ratio: int, overlap: bool):
    """NumPy twin of compressor_push."""
    slot = int(np.asarray(pos)[0]) % ratio
    row = ratio + slot if overlap else slot
    state_kv[row] = kvp
    state_score[row] = g + bias[slot]
    return state_kv


def compressor_pool(state_kv, state_score, norm_w, freqs, pos, comp, ratio: int, overlap: bool,
                    rope_dim: int, eps: float = 1e-6):
    """If token pos closes a window, pool it into comp[(pos + 1) // ratio - 1] (spec 3.5)."""
    hd = comp.shape[1]
    block = (hd + 31) // 32 * 32
    args = (ptr(state_kv), ptr(state_score), ptr(norm_w), ptr(freqs), ptr(pos), ptr(comp),
            i32(ratio), i32(hd), i32(int(overlap)), i32(rope_dim), f32(eps))
    launch("compressor", "compressor_pool", (1,), (block,), args, shared=4 * hd)
    return comp


def compressor_pool_numpy(state_kv, state_score, norm_w, freqs, pos, comp, ratio: int,
                          overlap: bool, rope_dim: int, eps: float = 1e-6):
    """NumPy twin of compressor_pool."""
    t = int(np.asarray(pos)[0])
    if (t + 1) % ratio:
        return comp
    w, hd = (t + 1) // ratio - 1, comp.shape[1]
    if overlap:
        vals = np.concatenate([state_kv[:ratio, :hd], state_kv[ratio:, hd:]])
        scores = np.concatenate([state_score[:ratio, :hd], state_score[ratio:, hd:]])
    else:
        vals, scores = state_kv[:ratio], state_score[:ratio]
    e = np.exp(scores - scores.max(axis=0, keepdims=True))
    pooled = (e * vals).sum(axis=0) / e.sum(axis=0)
    row = rms_norm_numpy(pooled[None, :], norm_w, np.empty((1, hd), np.float32), eps)
    cos, sin = rope_angles_numpy([ratio * w], freqs)
    comp[w] = rotate_numpy(row, cos, sin, rope_dim)[0]
    if overlap:
        state_kv[:ratio] = state_kv[ratio:]
        state_score[:ratio] = state_score[ratio:]
    return comp
