"""Attention for every layer type (spec §3.4, §3.7): sliding window + compressed rows, sinks."""

from __future__ import annotations

from ds4.model.compressor import compress
from ds4.model.config import CSA, SLIDING
from ds4.model.hyper_connection import rms_scale
from ds4.model.indexer import select_entries


def attention(xp, ctx, lw, layer_state, h, step):
    """Attention output [S, D] for h [S, D] (normed sub-block input) of one chunk.

    `ctx` carries config, ropes, scratch and the quantisation switches; `step` carries this
    chunk's positions, start and the cos/sin of each rope kind.
    """
    cfg = ctx.cfg
    S, H, d, eps = h.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    rope_kind = "main" if layer_state.kind == SLIDING else "compress"
    rope, (cos, sin) = ctx.ropes[rope_kind], step.cos_sin[rope_kind]
    qlat = h @ lw["self_attn.q_a_proj.weight"].T
    qlat = qlat * rms_scale(xp, qlat, eps) * lw["self_attn.q_a_norm.weight"]
    q = (qlat @ lw["self_attn.q_b_proj.weight"].T).reshape(S, H, d)
    q = rope.apply(q * rms_scale(xp, q, eps), cos, sin)
    kv = h @ lw["self_attn.kv_proj.weight"].T
    kv = rope.apply(kv * rms_scale(xp, kv, eps) * lw["self_attn.kv_norm.weight"], cos, sin)
    if ctx.kv_fp8 is not None:
        kv = ctx.kv_fp8(kv)
    keys, bias = _raw_keys(xp, ctx, layer_state, kv, step)
    picked = None
    if layer_state.compressor is not None:
        keys, bias, picked = _with_compressed(xp, ctx, lw, layer_state, h, qlat, step, keys, bias)
    _store_raw(layer_state, kv, step.start)
    out = _softmax_with_sink(xp, q, keys, bias, picked, lw["self_attn.sinks"], d ** -0.5)
    out = rope.apply(out, cos, sin, inverse=True)
    return _grouped_output(xp, cfg, lw, out)


def _raw_keys(xp, ctx, layer_state, kv, step):
    """Ring rows (positions < start) then this chunk's rows, with the sliding-window mask."""
    W, S = layer_state.raw.shape[0], kv.shape[0]
    keys = ctx.scratch.view("raw_keys", (W + S, kv.shape[1]))
    keys[:W] = layer_state.raw
    keys[W:] = kv
    return keys, step.window_bias


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


def _with_compressed(xp, ctx, lw, layer_state, h, qlat, step, keys, bias):
    """Append the layer's usable compressed rows (HCA: all closed; CSA: indexer picks)."""
    cfg = ctx.cfg
    comp = layer_state.compressor
    rope = ctx.ropes["compress"]

    def weight(name):
        return lw["self_attn.compressor." + name]

    count = compress(xp, weight, comp, h, step.positions, step.start, rope, cfg.rms_norm_eps, ctx.kv_fp8)
    if layer_state.kind == CSA:  # the indexer's own compressor sees every token, rows or not
        cos_q, sin_q = step.cos_sin["compress"]
        picks = select_entries(xp, lw, cfg, layer_state, h, qlat, step.positions, step.start, rope,
                               cos_q, sin_q, ctx.indexer_qat)
    if count == 0:
        return keys, bias, None
    rows = comp.rows[:count]
    if layer_state.kind != CSA:
        usable = (step.positions + 1) // comp.ratio
        extra = xp.where(xp.arange(count)[None, :] < usable[:, None], 0.0, -xp.inf)
        return xp.concatenate([keys, rows]), xp.concatenate([bias, extra.astype(xp.float32)], axis=1), None
    # each query gathers its own picks: memory S x topk x d, never S x (all rows)
    picked_rows = rows[xp.maximum(picks, 0)]
    picked_bias = xp.where(picks >= 0, 0.0, -xp.inf).astype(xp.float32)
    return keys, bias, (picked_rows, picked_bias)


def _softmax_with_sink(xp, q, keys, bias, picked, sinks, scale: float):
    """o_h = sum_j p_j k_j with p = exp(l) / (exp(sink_h) + sum exp(l)) (V = K), fp32.

    Keys come as rows shared by all queries ([K, d] with bias [S, K]) plus, for CSA, rows
    picked per query ([S, k, d] with bias [S, k]).
    """
    blocks = [(keys, xp.matmul(q, keys.T) * scale + bias[:, None, :])]  # [S, H, K]
    if picked is not None and picked[0].shape[1]:
        rows, picked_bias = picked
        blocks.append((rows, xp.matmul(q, rows.transpose(0, 2, 1)) * scale + picked_bias[:, None, :]))
    top = sinks[None, :]
    for _, logits in blocks:
        top = xp.maximum(top, logits.max(axis=-1))  # [S, H]
    denom = xp.exp(sinks[None, :] - top)
    out = 0.0
    for rows, logits in blocks:
        p = xp.exp(logits - top[:, :, None])
        denom = denom + p.sum(axis=-1)
        out = out + xp.matmul(p, rows)
    return out / denom[:, :, None]


def _grouped_output(xp, cfg, lw, out):
    """Heads in o_groups groups: z_g = W_oa[g] @ o_g, then a = W_ob @ concat(z)."""
    S, G = out.shape[0], cfg.o_groups
    grouped = out.reshape(S, G, -1).transpose(1, 0, 2)  # [G, S, H/G*d]
    w_oa = lw["self_attn.o_a_proj.weight"].reshape(G, cfg.o_lora_rank, -1)
    z = xp.matmul(grouped, w_oa.transpose(0, 2, 1))  # [G, S, o_lora_rank]
    z = z.transpose(1, 0, 2).reshape(S, -1)
    return z @ lw["self_attn.o_b_proj.weight"].T
