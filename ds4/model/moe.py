"""Mixture of experts (spec §3.8): hash or top-k routing, clamped SwiGLU experts + shared expert."""

from __future__ import annotations

import numpy as np

from ds4.model.hyper_connection import sigmoid
from ds4.model.linear import batched_linear, linear


def router_scores(xp, cfg, logits):
    """Per-expert scores in fp32 (sqrt(softplus) for V4)."""
    if cfg.scoring_func == "sqrtsoftplus":
        return xp.sqrt(xp.logaddexp(0.0, logits))
    if cfg.scoring_func == "sigmoid":
        return sigmoid(xp, logits)
    shifted = xp.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def route(xp, cfg, lw, x, token_ids, hashed: bool):
    """(expert ids [S, k], weights [S, k]); ties pick the lower expert id."""
    scores = router_scores(xp, cfg, linear(xp, x, lw["mlp.gate.weight"]))
    if hashed:
        ids = lw["mlp.gate.tid2eid"][token_ids]
    else:
        biased = scores + lw["mlp.gate.e_score_correction_bias"]
        ids = xp.argsort(-biased, axis=-1, kind="stable")[:, : cfg.num_experts_per_tok]
    weights = xp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob or cfg.scoring_func != "softmax":
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def swiglu(xp, gate, up, limit: float):
    """silu(min(gate, limit)) * clip(up, -limit, limit); no clamp when limit <= 0."""
    if limit > 0:
        gate = xp.minimum(gate, limit)
        up = xp.clip(up, -limit, limit)
    return gate * sigmoid(xp, gate) * up


def moe(xp, cfg, lw, x, token_ids, hashed: bool, to_host):
    """f = sum_k w_k expert_k(x) + shared(x) for x [S, D]."""
    ids, weights = route(xp, cfg, lw, x, token_ids, hashed)
    if x.shape[0] == 1:
        routed = _routed_one(xp, cfg, lw.experts, x[0], ids[0], weights[0])[None, :]
    elif xp is not np and lw.experts.resident:
        routed = _routed_grouped(xp, cfg, lw.experts, x, ids, weights, to_host)
    else:
        routed = _routed_many(xp, cfg, lw.experts, x, ids, weights, to_host(ids))
    if "mlp.shared_experts.gate_proj.weight" not in lw:
        return routed
    gate = linear(xp, x, lw["mlp.shared_experts.gate_proj.weight"])
    up = linear(xp, x, lw["mlp.shared_experts.up_proj.weight"])
    return routed + linear(xp, swiglu(xp, gate, up, cfg.swiglu_limit), lw["mlp.shared_experts.down_proj.weight"])


def _routed_one(xp, cfg, bank, x, ids, weights):
    """Decode: the k picked experts as one batched product (duplicate picks simply add)."""
    gate_up, down = bank.gather(ids)  # [k, 2I, D], [k, D, I]
    inter = cfg.moe_intermediate_size
    y = xp.matmul(gate_up, x)  # [k, 2I]
    act = swiglu(xp, y[:, :inter], y[:, inter:], cfg.swiglu_limit) * weights[:, None]
    return xp.matmul(down, act[:, :, None])[:, :, 0].sum(axis=0)


def _routed_many(xp, cfg, bank, x, ids, weights, host_ids: np.ndarray):
    """Prefill: one product per expert that any token of the chunk picked."""
    out = xp.zeros_like(x)
    inter = cfg.moe_intermediate_size
    for e in np.unique(host_ids).tolist():
        rows = xp.asarray(np.nonzero((host_ids == e).any(axis=1))[0])
        w = (weights * (ids == e)).sum(axis=1)[rows]
        gate_up, down = bank.expert(e)
        y = x[rows] @ gate_up.T
        act = swiglu(xp, y[:, :inter], y[:, inter:], cfg.swiglu_limit) * w[:, None]
        out[rows] += act @ down.T
    return out


PADDED_BYTES = 2 << 30  # the grouped path's largest [experts, rows, 2I] fp32 product


def _routed_grouped(xp, cfg, bank, x, ids, weights, to_host):
    """Prefill on the GPU: every expert's picks padded to the busiest one's count, so each of
    gate/up and down is ONE batched GEMM over the stacked experts (each expert read once).
    Routing so skewed that the padding would not fit falls back to one product per expert."""
    S, k = ids.shape
    E, inter = bank.count, cfg.moe_intermediate_size
    flat = ids.reshape(-1)
    counts = xp.bincount(flat, minlength=E)
    M = int(counts.max())
    if E * M * 2 * inter * 4 > PADDED_BYTES:
        return _routed_many(xp, cfg, bank, x, ids, weights, to_host(ids))
    order = xp.argsort(flat)
    starts = xp.cumsum(counts) - counts
    slot = xp.empty(S * k, dtype=xp.int64)  # where each (token, pick) sits in [E, M]
    slot[order] = flat[order] * M + xp.arange(S * k) - starts[flat[order]]
    token = xp.full(E * M, S, dtype=xp.int64)  # S = the zero row that pads
    token[slot] = xp.arange(S * k) // k
    scale = xp.zeros(E * M, dtype=xp.float32)
    scale[slot] = weights.reshape(-1)
    padded = xp.concatenate([x, xp.zeros((1, x.shape[1]), x.dtype)])[token].reshape(E, M, -1)
    gate_up, down = bank.stacked
    y = batched_linear(xp, padded, gate_up)  # [E, M, 2I]
    act = swiglu(xp, y[..., :inter], y[..., inter:], cfg.swiglu_limit) * scale.reshape(E, M, 1)
    out = batched_linear(xp, act, down).reshape(E * M, -1)
    return out[slot].reshape(S, k, -1).sum(axis=1)
