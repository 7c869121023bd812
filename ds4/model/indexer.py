"""Lightning indexer (spec §3.6): picks the top-k compressed entries each CSA query attends to."""

from __future__ import annotations

from ds4.model.compressor import compress


def select_entries(xp, lw, cfg, layer_state, h, qlat, positions, start: int, rope, cos_q, sin_q,
                   qat=None):
    """Top-k entry ids [S, k] per query (score desc, then lower index; -1 = nothing there).

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
    total = index_scores(xp, weight, cfg, h, qlat, comp.rows[:count], rope, cos_q, sin_q, qat)
    future = xp.arange(count)[None, :] >= usable[:, None]
    total = xp.where(future, -xp.inf, total)
    order = xp.argsort(-total, axis=-1, kind="stable")[:, :topk]
    return xp.where(order < usable[:, None], order, -1)


def index_scores(xp, weight, cfg, h, qlat, keys, rope, cos_q, sin_q, qat=None):
    """score[t, s] = sum_h w_th * relu(q_th . k_s) / sqrt(dim), w = W_proj h / sqrt(heads)."""
    S, heads, dim = h.shape[0], cfg.index_n_heads, cfg.index_head_dim
    q = (qlat @ weight("q_b_proj.weight").T).reshape(S, heads, dim)
    q = rope.apply(q, cos_q, sin_q)
    if qat is not None:
        q = qat(q)
    head_w = (h @ weight("scorer.weights_proj.weight").T) * heads ** -0.5
    scores = xp.maximum(xp.matmul(q, keys.T), 0.0) * dim ** -0.5  # [S, heads, count]
    return xp.matmul(head_w[:, None, :], scores)[:, 0, :]
