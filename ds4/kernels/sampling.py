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


MIN_P_KEPT = 2048  # sampling.cu's cap on the tokens sample_min_p keeps


def sample_min_p(x, temperature: float, floor: float, u: float, out, top_p: float = 1.0,
                 sel=None):
    """out[0] = the token draw u in [0, 1) picks from logits x [n] under temperature, min_p
    (floor = log min_p) and top_p, as ds4/sampling.py's host path computes it, among all of x
    or the candidates sel [k] lists (top_k's, ascending ids: topk_select); -1 where no
    candidate or more than MIN_P_KEPT pass the floor. One launch."""
    assert x.ndim == 1 and x.strides[0] == x.itemsize
    n = x.shape[0] if sel is None else sel.shape[0]
    launch("sampling", "sample_min_p", (1,), (1024,),
           (ptr(x), NULL if sel is None else ptr(sel), i32(n), np.float32(temperature),
            np.float32(floor), np.float64(u), np.float64(top_p), ptr(out)))
    return out


def sample_min_p_numpy(x, temperature: float, floor: float, u: float, out, top_p: float = 1.0,
                       sel=None):
    """NumPy twin of sample_min_p. The candidates' mass for top_p is summed in NumPy's order,
    not the kernel's: the two cut differently only where a prefix's share lies within a few
    ulps of top_p."""
    x = np.asarray(x, dtype=np.float32)
    cand = np.arange(x.size) if sel is None else np.asarray(sel)
    with np.errstate(over="ignore", invalid="ignore"):
        s = (x[cand] - x[cand].max()) / np.float32(temperature)
        ids = np.flatnonzero(s >= np.float32(floor))
    if not 0 < ids.size <= MIN_P_KEPT:
        out[0] = -1
        return out
    if top_p < 1.0:  # the host's rule itself (s is already shifted: its peak is 0)
        ids = np.sort(top_p_prefix(s, ids, top_p, 0.0))
    cdf = np.cumsum(np.exp(s[ids].astype(np.float64)))
    out[0] = cand[ids[min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), ids.size - 1)]]
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


def rank_keys(values, ids):
    """int64 keys whose ascending order is descending value, then ascending id (ids < 2^32):
    the value's order-preserving bits above the id. One sort, or a partition for the best k,
    of these keys replaces a two-key lexsort or a stable argsort at a fraction of the time
    (host top_p, the NumPy indexer). -0.0 ranks with 0.0; every NaN last."""
    neg = np.negative(values, dtype=np.float32)
    neg += np.float32(0)
    nan = np.isnan(neg)
    if nan.any():
        neg[nan] = np.float32(np.nan)  # one NaN, the positive one: it sorts last
    bits = neg.view(np.int32)  # (in place from here: neg is this call's own)
    bits ^= (bits >> 31) & np.int32(0x7FFFFFFF)  # negative floats: reversed magnitude
    keys = bits.astype(np.int64)
    keys <<= 32
    keys |= np.asarray(ids, dtype=np.int64)
    return keys


KEY_IDS = 0xFFFFFFFF  # a rank key's id bits


def by_rank(scaled, ids) -> np.ndarray:
    """`ids` ordered by descending logit, then ascending id: one sort of rank keys, ~5x faster
    than a two-key lexsort over a 129280-token vocabulary, which top_p needs whenever the best
    1024 tokens hold too little mass (a flat distribution, a high temperature)."""
    return np.sort(rank_keys(scaled[ids], ids)) & KEY_IDS


def weights(values, peak) -> np.ndarray:
    """exp(value - peak) in float64 (as the device path computes it)."""
    return np.exp(values.astype(np.float64) - peak)


def top_p_prefix(scaled, ids, top_p: float, peak) -> np.ndarray:
    """`ids` (a prefix of the ranked tokens, e.g. min_p's survivors) ranked, cut to the
    shortest prefix whose share of the whole row's mass, exp(scaled - peak) in float64,
    reaches top_p: the host's rule (ds4/sampling.py) and sample_min_p's twin both use it."""
    ranked = by_rank(scaled, ids)
    cdf = np.cumsum(weights(scaled[ranked], peak)) / weights(scaled, peak).sum()
    return ranked[: int(np.searchsorted(cdf, top_p, side="left")) + 1]


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
