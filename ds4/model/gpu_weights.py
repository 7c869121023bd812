"""The model's tensors in the form the decode kernels read: bf16 words where exact, else fp32.

On the GPU the engine already holds every exactly-bf16 matrix and expert stack as raw 16-bit
words (ds4.model.weights); those pass through here as the same arrays, so each weight is in
device memory once. Other matrices (fp32 test checkpoints) are converted here when exact, and
the small fp32 tensors (norms, mHC, biases) are used as they are.
"""

from __future__ import annotations

import numpy as np

from ds4.kernels import exact_bf16
from ds4.model.config import CSA, SLIDING
from ds4.model.packed import FP4, PackedMatrix

LAYER_MATRICES = ("self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight",
                  "self_attn.kv_proj.weight", "self_attn.o_a_proj.weight",
                  "self_attn.o_b_proj.weight", "mlp.gate.weight")
COMPRESSOR_MATRICES = ("kv_proj.weight", "gate_proj.weight")
SHARED_EXPERT = ("gate_proj", "up_proj", "down_proj")


def kernel_weight(xp, w):
    """bf16 words (uint16) when every value of fp32 w is exactly bf16, else w itself (bf16
    words and packed FP8 / FP4 matrices pass through: the kernels read them in place)."""
    if isinstance(w, PackedMatrix) or getattr(w, "placed", False):
        return w
    if w.dtype == xp.uint16:
        return xp.ascontiguousarray(w)
    words = exact_bf16(w, xp)
    return words if words is not None else xp.ascontiguousarray(w, dtype=xp.float32)


def _float(xp, w):
    return xp.ascontiguousarray(w, dtype=xp.float32)


def layer_tensors(xp, cfg, weights, i: int) -> dict:
    """One layer's decode tensors by their HF names inside the layer (plus stacked experts)."""
    lw = weights.layer(i)
    t = {name: kernel_weight(xp, lw[name]) for name in LAYER_MATRICES}
    for name in ("attn_hc.fn", "attn_hc.base", "attn_hc.scale", "ffn_hc.fn", "ffn_hc.base",
                 "ffn_hc.scale", "input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_a_norm.weight", "self_attn.kv_norm.weight", "self_attn.sinks"):
        t[name] = _float(xp, lw[name])
    kind = cfg.layer_types[i]
    prefixes = [] if kind == SLIDING else ["self_attn.compressor."]
    if kind == CSA:
        prefixes.append("self_attn.compressor.indexer.")
        for name in ("q_b_proj.weight", "scorer.weights_proj.weight"):
            t[prefixes[1] + name] = kernel_weight(xp, lw[prefixes[1] + name])
    for p in prefixes:
        for name in COMPRESSOR_MATRICES:
            t[p + name] = kernel_weight(xp, lw[p + name])
        for name in ("position_bias", "kv_norm.weight"):
            t[p + name] = _float(xp, lw[p + name])
    if cfg.mlp_layer_types[i] == "hash_moe":
        t["mlp.gate.tid2eid"] = xp.ascontiguousarray(lw["mlp.gate.tid2eid"], dtype=xp.int32)
    else:
        t["mlp.gate.e_score_correction_bias"] = _float(xp, lw["mlp.gate.e_score_correction_bias"])
    if "mlp.shared_experts.gate_proj.weight" in lw:
        for name in SHARED_EXPERT:
            key = f"mlp.shared_experts.{name}.weight"
            t[key] = kernel_weight(xp, lw[key])
    t["experts.gate_up"], t["experts.down"] = _stacked_experts(xp, lw.experts)
    if getattr(lw.experts, "placed_stacks", ()):  # decode counts the picks of placed experts
        t["experts.counts"] = lw.experts.counts
    return t


def _stacked_experts(xp, bank):
    """(gate_up [E, 2I, D], down [E, D, I]): the bank's own resident stacks, read in place
    (they are already bf16 words where exact, so kernel_weight passes them through)."""
    return tuple(kernel_weight(xp, w) for w in bank.stacked)


def model_tensors(xp, weights) -> dict:
    """Embedding, head and final collapse tensors in kernel form."""
    return {"embed": kernel_weight(xp, weights["model.embed_tokens.weight"]),
            "head": kernel_weight(xp, weights["lm_head.weight"]),
            "norm": _float(xp, weights["model.norm.weight"]),
            "hc_fn": _float(xp, weights["model.hc_head.hc_fn"]),
            "hc_base": _float(xp, weights["model.hc_head.hc_base"]),
            "hc_scale": _float(xp, weights["model.hc_head.hc_scale"])}


def rope_frequencies(xp, rope) -> object:
    """A Rope's float64 inverse frequencies as the kernels' freqs argument."""
    return xp.ascontiguousarray(rope.inv_freq, dtype=xp.float64)


def supported(model) -> str | None:
    """Why the kernel decode cannot run this model (None when it can)."""
    cfg = model.cfg
    if model.quantize and (cfg.head_dim > 1024 or cfg.index_head_dim > 1024):
        return "FP8/FP4 simulation kernels take rows of at most 1024 channels"
    if cfg.scoring_func != "sqrtsoftplus":
        return f"router scoring {cfg.scoring_func!r}"
    if any(r.factor != 1.0 for r in model.ropes.values()):
        return "rope attention factor != 1"
    if cfg.hc_mult > 4 or cfg.n_routed_experts > 1024 or cfg.num_experts_per_tok > 32:
        return "hc_mult, experts or top-k beyond the kernels' fixed limits"  # (hc_unit: 4)
    if any(not b.resident for b in model.weights.experts):
        return "experts are not resident"
    widths = (cfg.hidden_size, cfg.q_lora_rank, cfg.moe_intermediate_size, cfg.o_lora_rank,
              cfg.num_attention_heads // cfg.o_groups * cfg.head_dim)
    if any(w % 8 for w in widths) or cfg.head_dim % 4 or cfg.index_head_dim % 4:
        return "a width not a multiple of 8 (16-byte loads)"
    if cfg.head_dim > 1024 or cfg.hidden_size > 8192:
        return "head_dim > 1024 or hidden_size > 8192 (one-block kernels)"
    return _packed_unsupported(model)


def _packed_unsupported(model) -> str | None:
    """Why the packed kernels cannot read this model's FP8 / FP4 weights (None when they can)."""
    weights = model.weights
    packed = [t for t in weights.tensors.values() if isinstance(t, PackedMatrix)]
    banks = [b for b in weights.experts if getattr(b, "packed", False)]
    for bank in banks:
        gate_up, down = bank.stacked
        if gate_up.fmt != FP4 and gate_up.shape[1] // 2 % gate_up.block[0]:
            return "FP8 experts whose gate / up halves split a scale tile"
        if getattr(bank, "placed_stacks", ()) and model.cfg.num_experts_per_tok > 32:
            return "placed experts take at most 32 picks a token"
        packed += [gate_up, down]
    if any(not m.kernel_ready for m in packed):
        return "a packed matrix the kernels cannot read (scale tile or width)"
    if banks and len(banks) != len(weights.experts):
        return "some layers' experts packed, others not"
    return None


def nbytes(tensors: dict) -> int:
    """Bytes of a tensor dict."""
    return int(sum(np.prod(t.shape) * t.dtype.itemsize for t in tensors.values()))
