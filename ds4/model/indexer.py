"""Lightning indexer (docs/MODEL.md, Indexer): the top-k compressed entries a CSA query sees."""

from __future__ import annotations

from ds4.model.compressor import compress
from ds4.model.linear import linear

SCORE_BLOCK = 1 << 26  # floats in one [queries, heads, entries] block of indexer scores


def select_entries(xp, lw, cfg, layer_state, h, qlat, positions, start: int, rope, cos_q, sin_q,
                   qat=None):
    """Top-k entry ids [S, k] per query: the k highest scores among the entries the query may
    see (ties: the lower index), in ascending index order, then -1 (nothing there).

    Also appends this chunk's closed windows to the indexer's compressed keys. `qat` is the
    optional Hadamard + FP4 simulation applied to keys and queries after RoPE.
    """
    comp = layer_state.indexer
    m, topk = comp.ratio, cfg.index_topk

    def weight(name):
        return lw["self_attn.compressor.indexer." + name]

    count = compress(xp, weight, comp, h, positions, start, rope, cfg.rms_norm_eps, qat)
    usable = (positions + 1) // m  # [S] entries query t may see
    if count <= topk:  # every usable entry is selected; no scoring needed
        ids = xp.broadcast_to(xp.arange(count), (h.shape[0], count))
        return xp.where(ids < usable[:, None], ids, -1)
    keys = comp.rows[:count]
    # bound the [queries, heads, entries] score block: long prompts score a slice of
    # queries at a time
    block = max(1, min(SCORE_BLOCK // (cfg.index_n_heads * count), 1 << 15))  # <= grid z
    picks = []
    for b in range(0, h.shape[0], block):
        q_slice = slice(b, b + block)
        total = index_scores(xp, weight, cfg, h[q_slice], qlat[q_slice], keys, rope, cos_q[q_slice],
                             sin_q[q_slice], qat)
        picks.append(top_entries(xp, total, positions[q_slice], m, topk))
    return picks[0] if len(picks) == 1 else xp.concatenate(picks)


def top_entries(xp, total, positions, ratio: int, topk: int):
    """[S, topk] ids of each row's topk highest scores among its first (position + 1) // ratio
    entries (ties: the lower index), ascending, then -1. On the GPU one radix-select block a
    query (the decode graph's kernel): with a stable argsort of every row instead, the indexer
    held ~11 ms of a CSA layer's 2048-token chunk on average over a 16k prompt, more than the
    attention (docs/PERF.md)."""
    count = total.shape[1]
    if xp.__name__ != "numpy":
        from ds4.kernels import sampling

        rows = total.shape[0]
        sel = xp.empty((rows, topk), xp.int32)
        taken = xp.empty(rows, xp.int32)
        sampling.topk_select(xp.ascontiguousarray(total, dtype=xp.float32), topk, sel, taken,
                             pos=xp.ascontiguousarray(positions, dtype=xp.int32), ratio=ratio)
        return xp.where(xp.arange(topk)[None, :] < taken[:, None], sel, -1)
    from ds4.kernels.sampling import KEY_IDS, rank_keys

    seen = ((positions + 1) // ratio)[:, None]
    total = xp.where(xp.arange(count)[None, :] >= seen, -xp.inf, total)
    keys = rank_keys(total, xp.arange(count)[None, :])  # best first, ties: the lower id
    if topk < count:  # the k best keys in O(count) a row, not a stable argsort of the row
        keys = xp.partition(keys, topk - 1, axis=-1)[:, :topk]
    order = xp.sort(keys, axis=-1) & KEY_IDS
    order = xp.sort(xp.where(order < seen, order, count), axis=-1)  # unseen ids sort last
    return xp.where(order < count, order, -1)


def index_scores(xp, weight, cfg, h, qlat, keys, rope, cos_q, sin_q, qat=None):
    """score[t, s] = sum_h w_th * relu(q_th . k_s) / sqrt(dim), w = W_proj h / sqrt(heads)."""
    S, heads, dim = h.shape[0], cfg.index_n_heads, cfg.index_head_dim
    q = linear(xp, qlat, weight("q_b_proj.weight")).reshape(S, heads, dim)
    q = rope.rotate(q, cos_q, sin_q)
    if qat is not None:
        q = qat(q)
    head_w = linear(xp, h, weight("scorer.weights_proj.weight")) * heads ** -0.5
    count = keys.shape[0]
    if xp.__name__ == "numpy":  # one GEMM: a [heads, dim] product a query was ~5x slower
        dots = (q.reshape(S * heads, dim) @ keys.T).reshape(S, heads, count)
    elif qat is not None:
        dots = fp4_dots(xp, q, keys)
    else:
        dots = xp.matmul(q, keys.T)  # [S, heads, count]
    if xp.__name__ != "numpy":  # relu, scale and head sum in one pass over the products
        from ds4.kernels.indexer import indexer_head_sum

        return indexer_head_sum(xp.ascontiguousarray(dots, dtype=xp.float32),
                                xp.ascontiguousarray(head_w, dtype=xp.float32),
                                dim ** -0.5, xp.empty((S, count), xp.float32))
    scores = xp.maximum(dots, 0.0, out=dots)  # in place: [S, heads, count] is the largest
    scores *= xp.float32(dim ** -0.5)            # array of a long prompt's chunk
    return xp.matmul(head_w[:, None, :], scores)[:, 0, :]


def fp4_dots(cp, q, keys):
    """q [S, heads, dim] times keys [count, dim] transposed, both FP4-simulated (an E2M1 value
    times a power of two: exact in bf16), as one bf16 GEMM on tensor cores with fp32 sums.
    Every product is exact as in fp32; only the sums' order differs. The fp32 matmul held most
    of the indexer's own time at depth (docs/PERF.md)."""
    from ds4.kernels.split import split_bf16
    from ds4.model.linear import ZERO, _gemm

    S, heads, dim = q.shape
    count = keys.shape[0]

    def words(rows):  # one bf16 word a value (parts 1): the rounding is exact here
        rows = cp.ascontiguousarray(rows, dtype=cp.float32).reshape(-1, 1, dim)
        return split_bf16(rows, cp.empty(rows.shape, cp.uint16))

    y = cp.empty((S, heads, count), cp.float32)
    _gemm(cp, words(keys), 0, words(q), dim, 0, y, count, 0, (count, S * heads, dim, 1), ZERO)
    return y
