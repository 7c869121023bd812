"""KV-compressor launchers (ds4/kernels/compressor.cu) and their NumPy twins.

State layout as in ds4/model/state.py: pending_kv/pending_score [m, cw], overlap_kv/overlap_score
[m, hd] (None for HCA, which has no overlap), comp [capacity, hd]."""

from __future__ import annotations

import numpy as np

from ds4.kernels import f32, i32, launch, ptr
from ds4.kernels.norm import rms_norm_numpy
from ds4.kernels.rope import rope_angles_numpy, rotate_numpy


def compressor_push(kvp, g, bias, pos, pending_kv, pending_score):
    """Write token pos's projected kv and gate + bias[pos % m] at pending slot pos % m."""
    m, cw = pending_kv.shape
    args = (ptr(kvp), ptr(g), ptr(bias), ptr(pos), ptr(pending_kv), ptr(pending_score), i32(m),
            i32(cw))
    launch("compressor", "compressor_push", ((cw + 255) // 256,), (256,), args)
    return pending_kv


def compressor_push_numpy(kvp, g, bias, pos, pending_kv, pending_score):
    """NumPy twin of compressor_push."""
    slot = int(np.asarray(pos)[0]) % pending_kv.shape[0]
    pending_kv[slot] = kvp
    pending_score[slot] = g + bias[slot]
    return pending_kv


def compressor_pool(pending_kv, pending_score, overlap_kv, overlap_score, norm_w, freqs, pos,
                    comp, rope_dim: int, eps: float = 1e-6):
    """If token pos closes a window, pool it into comp[(pos + 1) // m - 1]."""
    m = pending_kv.shape[0]
    hd = comp.shape[1]
    block = (hd + 31) // 32 * 32
    args = (ptr(pending_kv), ptr(pending_score), ptr(overlap_kv), ptr(overlap_score), ptr(norm_w),
            ptr(freqs), ptr(pos), ptr(comp), i32(m), i32(hd), i32(rope_dim), f32(eps))
    launch("compressor", "compressor_pool", (1,), (block,), args, shared=4 * hd)
    return comp


def compressor_pool_numpy(pending_kv, pending_score, overlap_kv, overlap_score, norm_w, freqs,
                          pos, comp, rope_dim: int, eps: float = 1e-6):
    """NumPy twin of compressor_pool."""
    m, hd = pending_kv.shape[0], comp.shape[1]
    t = int(np.asarray(pos)[0])
    if (t + 1) % m:
        return comp
    w = (t + 1) // m - 1
    if overlap_kv is not None:
        vals = np.concatenate([overlap_kv, pending_kv[:, hd:]])
        scores = np.concatenate([overlap_score, pending_score[:, hd:]])
    else:
        vals, scores = pending_kv, pending_score
    e = np.exp(scores - scores.max(axis=0, keepdims=True))
    pooled = (e * vals).sum(axis=0) / e.sum(axis=0)
    row = rms_norm_numpy(pooled[None, :], norm_w, np.empty((1, hd), np.float32), eps)
    cos, sin = rope_angles_numpy([m * w], freqs)
    comp[w] = rotate_numpy(row, cos, sin, rope_dim)[0]
    if overlap_kv is not None:
        overlap_kv[...] = pending_kv[:, :hd]
        overlap_score[...] = pending_score[:, :hd]
    return comp


def compressor_pool_windows(win_kv, win_score, overlap_kv, overlap_score, pooled):
    """pooled [nw, hd] = the softmax pool of each closed window of win_kv / win_score
    [nw, m, cw] (prefill), over the carried overlap_* [m, hd] for window 0 (None: no
    overlap)."""
    nw, m, _ = win_kv.shape
    hd = pooled.shape[1]
    args = (ptr(win_kv), ptr(win_score), ptr(overlap_kv), ptr(overlap_score), ptr(pooled), i32(m),
            i32(hd))
    launch("compressor", "compressor_pool_windows", ((hd + 127) // 128, nw), (128,), args)
    return pooled


def compressor_pool_windows_numpy(win_kv, win_score, overlap_kv, overlap_score, pooled):
    """NumPy twin of compressor_pool_windows."""
    hd = pooled.shape[1]
    kv, score = win_kv, win_score
    if overlap_kv is not None:
        kv = np.concatenate([np.concatenate([overlap_kv[None], win_kv[:-1, :, :hd]]),
                             win_kv[:, :, hd:]], axis=1)
        score = np.concatenate([np.concatenate([overlap_score[None], win_score[:-1, :, :hd]]),
                                win_score[:, :, hd:]], axis=1)
    e = np.exp(score - score.max(axis=1, keepdims=True))
    pooled[...] = (e * kv).sum(axis=1) / e.sum(axis=1)
    return pooled


def compressor_step_m(kvp, g, bias, table, layer: int, slot: int, norm_w, freqs, m: int,
                      cw: int, hd: int, rope_dim: int, eps: float = 1e-6):
    """compressor_push then compressor_pool, in one launch, for each member b of a batch graph:
    kvp, g [B, >= cw] (row b: member b's projections); the member's state from the member
    table's slot groups starting at `slot` (pending_kv, pending_score, overlap_kv,
    overlap_score, rows)."""
    assert cw in (hd, 2 * hd) and hd <= 1024
    block = (hd + 31) // 32 * 32
    args = (ptr(kvp), ptr(g), i32(kvp.shape[1]), ptr(bias), ptr(table.pos),
            table.group(layer, slot), ptr(norm_w), ptr(freqs), i32(m), i32(cw), i32(hd),
            i32(rope_dim), f32(eps))
    launch("compressor", "compressor_step_m", (1, 1, kvp.shape[0]), (block,), args,
           shared=4 * hd)
    return kvp


def compressor_step_m_numpy(kvp, g, bias, table, layer: int, slot: int, norm_w, freqs, m: int,
                            cw: int, hd: int, rope_dim: int, eps: float = 1e-6):
    """NumPy twin of compressor_step_m."""
    groups = [table.arrays(layer, slot + k) for k in range(5)]
    for b, (pkv, psc, okv, osc, rows) in enumerate(zip(*groups)):
        at = table.pos[b:b + 1]
        compressor_push_numpy(kvp[b, :cw], g[b, :cw], bias, at, pkv, psc)
        compressor_pool_numpy(pkv, psc, okv, osc, norm_w, freqs, at, rows, rope_dim, eps)
    return kvp
