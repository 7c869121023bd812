"""Lightning-indexer score launcher (ds4/kernels/indexer.cu) and its NumPy twin."""

from __future__ import annotations

import numpy as np

from ds4.kernels import f32, i32, launch, ptr

ENTRIES = 32  # entries per block, as in indexer.cu


def indexer_scores(q, wts, keys, pos, ratio: int, scores):
    """scores[s] = sum_h wts[h] relu(q[h] . keys[s]) / sqrt(heads * hd), s < (pos+1)//ratio."""
    heads, hd = q.shape
    cap = keys.shape[0]
    shared = 4 * (heads + ENTRIES) * (hd + 1)
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
