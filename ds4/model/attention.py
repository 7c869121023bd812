"""Attention of every layer type (docs/MODEL.md, Attention): window, compressed rows, sinks."""

from __future__ import annotations

import numpy as np

from ds4.kernels.chunk_attention import chunk_attention, kernel_fits, words_size
from ds4.model.compressor import compress
from ds4.model.config import CSA, SLIDING
from ds4.model.hyper_connection import rms_norm
from ds4.model.indexer import select_entries
from ds4.model.linear import grouped_rows_linear, held, linear, parts


def attention(xp, ctx, lw, layer_state, h, step):
    """Attention output [S, D] for h [S, D] (normed sub-block input) of one chunk.

    `ctx` carries config, ropes, scratch and the quantisation switches; `step` carries this
    chunk's positions, start and the cos/sin of each rope kind.
    """
    rope_kind = "main" if layer_state.kind == SLIDING else "compress"
    cos, sin = step.cos_sin[rope_kind]
    qlat, q, kv = _project(xp, ctx, lw, h, ctx.ropes[rope_kind], cos, sin)
    out = _attend(xp, ctx, lw, layer_state, h, qlat, q, kv, step)
    out = ctx.ropes[rope_kind].rotate(out, cos, sin, inverse=True)
    return _grouped_output(xp, ctx.cfg, lw, out)


def attention_rows(xp, ctx, lw, layer_states: list, h, steps: list, cos_sin: dict):
    """One token for each of B sessions: h [B, D] -> [B, D].

    The projections multiply the [B, D] block (each weight read once for all rows); the
    window, the compressors and the indexer run on each session's own state and `Step`.
    `cos_sin` holds each rope kind at the B rows' positions.
    """
    rope_kind = "main" if layer_states[0].kind == SLIDING else "compress"
    cos, sin = cos_sin[rope_kind]
    qlat, q, kv = _project(xp, ctx, lw, h, ctx.ropes[rope_kind], cos, sin)
    out = xp.empty_like(q)
    for b, (layer_state, step) in enumerate(zip(layer_states, steps)):
        rows = slice(b, b + 1)
        out[rows] = _attend(xp, ctx, lw, layer_state, h[rows], qlat[rows], q[rows], kv[rows], step)
    out = ctx.ropes[rope_kind].rotate(out, cos, sin, inverse=True)
    return _grouped_output(xp, ctx.cfg, lw, out)


def _project(xp, ctx, lw, h, rope, cos, sin):
    """(q latent [S, q_lora], roped queries [S, H, d], roped kv row [S, d]) of h [S, D]."""
    cfg = ctx.cfg
    S, H, d, eps = h.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    qlat = linear(xp, h, lw["self_attn.q_a_proj.weight"])
    qlat = rms_norm(xp, qlat, lw["self_attn.q_a_norm.weight"], eps)
    q = linear(xp, qlat, lw["self_attn.q_b_proj.weight"]).reshape(S, H, d)
    q = rope.rotate(rms_norm(xp, q, None, eps), cos, sin)
    kv = linear(xp, h, lw["self_attn.kv_proj.weight"])
    kv = rope.rotate(rms_norm(xp, kv, lw["self_attn.kv_norm.weight"], eps), cos, sin)
    if ctx.kv_fp8 is not None:
        kv = ctx.kv_fp8(kv)
    return qlat, q, kv


def _attend(xp, ctx, lw, layer_state, h, qlat, q, kv, step):
    """Per-head outputs [S, H, d] (still roped) of one session's chunk against its own state."""
    keys = _raw_keys(ctx, layer_state, kv)
    rows, picks = _compressed_rows(xp, ctx, lw, layer_state, h, qlat, step)
    _store_raw(layer_state, kv, step.start)
    ratio = layer_state.compressor.ratio if rows is not None else 0
    fused = xp is not np and step.dense_window and kernel_fits(ctx.cfg.head_dim, parts())
    if fused:  # one kernel
        size = words_size(keys, rows, parts())
        words = ctx.scratch.view("attention_words", (size,), xp.uint16)
        exact = ctx.cfg.head_dim - ctx.cfg.qk_rope_head_dim if ctx.kv_fp8 is not None else 0
        return chunk_attention(q, keys, rows, picks, ratio, step.start, lw["self_attn.sinks"],
                               xp.empty_like(q), words, parts(), exact)  # FP8 dims: no lo words
    return attend_keys(xp, q, keys, rows, picks, ratio, step, lw["self_attn.sinks"])


def attend_keys(xp, q, keys, rows, picks, ratio: int, step, sinks):
    """The model code's softmax of q [S, H, d] over the raw keys [W + S, d] (ring, then chunk)
    and the compressed rows (None, all usable, or `picks` [S, k]), 256 queries at a time."""
    S, d = q.shape[0], q.shape[2]
    parts = [_window_part(keys, step.window_bias, keys.shape[0] - S)]
    if rows is not None:
        parts.append(_compressed_part(xp, rows, picks, step, ratio))
    out = xp.empty_like(q)
    for i0 in range(0, S, QUERY_BLOCK):  # scores stay [block, H, window + block], not [S, H, S]
        i1 = min(S, i0 + QUERY_BLOCK)
        blocks = [b for b in (part(i0, i1) for part in parts) if b[1].shape[-1]]  # keys there
        out[i0:i1] = _softmax_with_sink(xp, q[i0:i1], blocks, sinks, d ** -0.5)
    return out


QUERY_BLOCK = 256


def _raw_keys(ctx, layer_state, kv):
    """Ring rows (positions < start) then this chunk's rows: [W + S, d]."""
    W, S = layer_state.raw.shape[0], kv.shape[0]
    keys = ctx.scratch.view("raw_keys", (W + S, kv.shape[1]))
    keys[:W] = layer_state.raw
    keys[W:] = kv
    return keys


def _window_part(keys, bias, W: int):
    """Keys of queries i0..i1: ring rows while i0 < W, then chunk rows from i0 - W + 1 on."""
    def block(i0: int, i1: int):
        lo = 0 if i0 < W else i0 + 1
        return keys[lo : W + i1], bias[i0:i1, lo : W + i1]
    return block


def window_bias(xp, start: int, positions, window: int):
    """[S, W + S] additive mask over (ring slots, chunk rows): 0 where t - W < p <= t, else -inf."""
    slots = xp.arange(window)
    ring_pos = start - 1 - (start - 1 - slots) % window  # newest position in each slot (< 0: empty)
    key_pos = xp.concatenate([ring_pos, positions])[None, :]
    t = positions[:, None]
    visible = (key_pos <= t) & (key_pos > t - window) & (key_pos >= 0)
    return xp.where(visible, 0.0, -xp.inf).astype(xp.float32)


def _store_raw(layer_state, kv, start: int) -> None:
    W = layer_state.raw.shape[0]
    S = kv.shape[0]
    keep = min(S, W)
    slots = [(start + S - keep + i) % W for i in range(keep)]
    layer_state.raw[slots] = kv[S - keep :]


def _compressed_rows(xp, ctx, lw, layer_state, h, qlat, step):
    """(rows [count, d], picks [S, k] or None = every usable row) of the layer's compressed
    rows after this chunk (HCA: all closed; CSA: the indexer's picks); (None, None): none."""
    cfg = ctx.cfg
    comp = layer_state.compressor
    if comp is None:
        return None, None
    rope = ctx.ropes["compress"]

    def weight(name):
        return lw["self_attn.compressor." + name]

    count = compress(xp, weight, comp, h, step.positions, step.start, rope, cfg.rms_norm_eps,
                     ctx.kv_fp8)
    if layer_state.kind == CSA:  # the indexer's own compressor sees every token, rows or not
        cos_q, sin_q = step.cos_sin["compress"]
        picks = select_entries(xp, lw, cfg, layer_state, h, qlat, step.positions, step.start, rope,
                               cos_q, sin_q, ctx.indexer_qat)
    if count == 0:
        return None, None
    if layer_state.kind != CSA or count <= cfg.index_topk:  # every usable row (CSA: all picked)
        return comp.rows[:count], None
    return (comp.rows[:count], picks) if picks.shape[1] else (None, None)


def _compressed_part(xp, rows, picks, step, ratio: int):
    """The compressed rows as a key part of query blocks: shared rows with a causal mask, or
    each query's own picks."""
    count = rows.shape[0]
    if picks is None:
        usable = (step.positions + 1) // ratio
        bias = xp.where(xp.arange(count)[None, :] < usable[:, None], 0.0,
                        -xp.inf).astype(xp.float32)

        def shared(i0: int, i1: int):
            """Rows up to the last one the block's newest query may see (none masked for all)."""
            seen = min(count, (step.start + i1) // ratio)
            return rows[:seen], bias[i0:i1, :seen]
        return shared

    def picked(i0: int, i1: int):
        """Each query's own picks, gathered per block: [block, k, d], never [S, k, d]."""
        ids = picks[i0:i1]
        return rows[xp.maximum(ids, 0)], xp.where(ids >= 0, 0.0, -xp.inf).astype(xp.float32)
    return picked


def _softmax_with_sink(xp, q, blocks, sinks, scale: float):
    """o_h = sum_j p_j k_j with p = exp(l) / (exp(sink_h) + sum exp(l)) (V = K), fp32.

    Each block of keys is rows shared by all queries ([K, d], bias [S, K]) or rows per query
    ([S, k, d], bias [S, k]).
    """
    S, H, d = q.shape
    logits = [_scores(xp, q, rows) * scale + bias[:, None, :] for rows, bias in blocks]
    top = sinks[None, :]
    for block in logits:
        top = xp.maximum(top, block.max(axis=-1))  # [S, H]
    denom = xp.exp(sinks[None, :] - top)
    out = 0.0
    for (rows, _), block in zip(blocks, logits):
        p = xp.exp(block - top[:, :, None])
        denom = denom + p.sum(axis=-1)
        shared = rows.ndim == 2
        out = out + ((p.reshape(S * H,
                                -1) @ rows).reshape(S, H, d) if shared else xp.matmul(p, rows))
    return out / denom[:, :, None]


def _scores(xp, q, rows):
    """q [S, H, d] against shared rows [K, d] (one GEMM) or per-query rows [S, k, d]."""
    S, H, d = q.shape
    if rows.ndim == 2:
        return (q.reshape(S * H, d) @ rows.T).reshape(S, H, -1)
    return xp.matmul(q, rows.transpose(0, 2, 1))


def _grouped_output(xp, cfg, lw, out):
    """Heads in o_groups groups: z_g = W_oa[g] @ o_g, then a = W_ob @ concat(z)."""
    S, G = out.shape[0], cfg.o_groups
    w_oa = held(xp, lw["self_attn.o_a_proj.weight"]).reshape(G, cfg.o_lora_rank, -1)
    z = grouped_rows_linear(xp, out.reshape(S, G, -1), w_oa)  # [S, G, o_lora_rank]
    return linear(xp, z.reshape(S, -1), lw["self_attn.o_b_proj.weight"])
