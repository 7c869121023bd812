"""Lightning-indexer score launcher (ds4/kernels/indexer.cu) and its NumPy twin."""

from __future__ import annotations

import numpy as np

from ds4.kernels import f32, i32, launch, ptr

ENTRIES = 32  # entries per block, as in indexer.cu


def indexer_scores(q, wts, keys, pos, ratio: int, scores):
    """scores[s] = sum_h wts[h] relu(q[h] . keys[s]) / sqrt(heads * hd), s < (pos+1)//ratio."""
    heads, hd = q.shape
    cap = keys.shape[0]
    shared = 4 * (heads + ENTRIES) * (hd + 4)
    args = (ptr(q), ptr(wts), ptr(keys), ptr(pos), i32(ratio), ptr(scores), i32(heads),
            i32(hd), f32((heads * hd) ** -0.5))
    launch("indexer", "indexer_scores", ((cap + ENTRIES - 1) // ENTRIES,), (256,), args, shared)
    return scores


def indexer_scores_numpy(q, wts, keys, pos, ratio: int, scores):
    """NumPy twin of indexer_scores."""
    heads, hd = q.shape
    n = (int(np.asarray(pos)[0]) + 1) // ratio
    dots = np.maximum(keys[:n] @ q.T, 0.0)
    scores[:n] = (dots @ wts) * np.float32((heads * hd) ** -0.5)
    return scores


def indexer_head_sum(dots, w, scale: float, out):
    """out[t, s] = sum_h w[t, h] * relu(dots[t, h, s]) * scale for dots [rows, heads, count] and
    w [rows, heads] (fp32, contiguous): prefill's scores from its GEMM's products."""
    rows, heads, count = dots.shape
    args = (ptr(dots), ptr(w), f32(scale), i32(heads), i32(count), ptr(out))
    launch("indexer", "indexer_head_sum", ((count + 255) // 256, rows), (256,), args, 4 * heads)
    return out


def indexer_head_sum_numpy(dots, w, scale: float, out):
    """NumPy twin of indexer_head_sum (the model code's NumPy arithmetic)."""
    scores = np.maximum(dots, 0.0) * np.float32(scale)
    out[...] = np.matmul(w[:, None, :], scores)[:, 0, :]
    return out


def indexer_scores_m(q, wts, table, layer: int, slot: int, rows: int, ratio: int, scores):
    """indexer_scores for each member b of a batch graph: q [B, heads, hd], wts [B, heads],
    scores [B, >= rows]; member b's keys (at most `rows` of them) from the member table."""
    batch, heads, hd = q.shape
    shared = 4 * (heads + ENTRIES) * (hd + 4)
    args = (ptr(q), ptr(wts), table.group(layer, slot), ptr(table.pos), i32(ratio), ptr(scores),
            i32(scores.shape[1]), i32(heads), i32(hd), f32((heads * hd) ** -0.5))
    launch("indexer", "indexer_scores_m", ((rows + ENTRIES - 1) // ENTRIES, 1, batch), (256,),
           args, shared)
    return scores


def indexer_scores_m_numpy(q, wts, table, layer: int, slot: int, rows: int, ratio: int, scores):
    """NumPy twin of indexer_scores_m."""
    for b, keys in enumerate(table.arrays(layer, slot)):
        indexer_scores_numpy(q[b], wts[b], keys, table.pos[b:b + 1], ratio, scores[b])
    return scores
