"""Checkpoint tensor names and shapes: the official release's names and transformers' (HF)
names mapped onto each other, and the shape every tensor must have for a configuration
(docs/MODEL.md, Weights)."""

from __future__ import annotations

import re

from ds4.model.config import CSA, HCA, SLIDING, ModelConfig
from ds4.model.safetensors_file import StoredTensor

# Official per-layer names (after "layers.{i}.") -> HF names (after "model.layers.{i}.").
OFFICIAL_LAYER_NAMES = {
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
}
OFFICIAL_LAYER_MODULES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn.wq_a": "self_attn.q_a_proj", "attn.q_norm": "self_attn.q_a_norm",
    "attn.wq_b": "self_attn.q_b_proj", "attn.wkv": "self_attn.kv_proj",
    "attn.kv_norm": "self_attn.kv_norm", "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj",
    "attn.compressor.norm": "self_attn.compressor.kv_norm",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj",
    "attn.indexer.compressor.norm": "self_attn.compressor.indexer.kv_norm",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj",
    "ffn.gate": "mlp.gate",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}
OFFICIAL_TOP = {
    "embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale",
}
# HF names inside a layer -> official names (after "layers.{i}."): the tables above, inverted.
HF_TO_OFFICIAL_LAYER = {hf: off for off, hf in OFFICIAL_LAYER_NAMES.items()}
HF_TO_OFFICIAL_LAYER.update({hf + ".weight": off + ".weight"
                             for off, hf in OFFICIAL_LAYER_MODULES.items()})
EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_name(official: str) -> str | None:
    """HF name of an official tensor name (None for experts, MTP and unknown names)."""
    if official in OFFICIAL_TOP:
        return OFFICIAL_TOP[official]
    m = LAYER_RE.match(official)
    if not m:
        return None
    layer, rel = m.groups()
    prefix = f"model.layers.{layer}."
    if rel in OFFICIAL_LAYER_NAMES:
        return prefix + OFFICIAL_LAYER_NAMES[rel]
    module, _, leaf = rel.rpartition(".")
    if module in OFFICIAL_LAYER_MODULES and leaf == "weight":
        return prefix + OFFICIAL_LAYER_MODULES[module] + ".weight"
    return None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every dense tensor the forward pass reads, by HF name, with its shape (experts excluded)."""
    D, V, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    mix = (2 + hc) * hc
    shapes = {
        "model.embed_tokens.weight": (V, D), "model.norm.weight": (D,),
        "model.hc_head.hc_fn": (hc, hc * D), "model.hc_head.hc_base": (hc,),
        "model.hc_head.hc_scale": (1,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in _layer_shapes(cfg, i, mix).items()})
    return shapes


def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The MTP block's layer tensors (HF names inside a layer): a sliding, non-hash layer."""
    mix = (2 + cfg.hc_mult) * cfg.hc_mult
    return _block_shapes(cfg, SLIDING, False, 0, mix)


def _layer_shapes(cfg: ModelConfig, i: int, mix: int) -> dict[str, tuple[int, ...]]:
    hashed = cfg.mlp_layer_types[i] == "hash_moe"
    return _block_shapes(cfg, cfg.layer_types[i], hashed, cfg.compress_ratio(i), mix)


def _block_shapes(cfg: ModelConfig, kind: str, hashed: bool, m: int,
                  mix: int) -> dict[str, tuple[int, ...]]:
    D, H, d, E = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.n_routed_experts
    inter = cfg.moe_intermediate_size * cfg.n_shared_experts
    s = {
        "attn_hc.fn": (mix, cfg.hc_mult * D), "attn_hc.base": (mix,), "attn_hc.scale": (3,),
        "ffn_hc.fn": (mix, cfg.hc_mult * D), "ffn_hc.base": (mix,), "ffn_hc.scale": (3,),
        "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
        "self_attn.q_a_proj.weight": (cfg.q_lora_rank, D),
        "self_attn.q_a_norm.weight": (cfg.q_lora_rank,),
        "self_attn.q_b_proj.weight": (H * d, cfg.q_lora_rank),
        "self_attn.kv_proj.weight": (d, D), "self_attn.kv_norm.weight": (d,),
        "self_attn.o_a_proj.weight": (cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups),
        "self_attn.o_b_proj.weight": (D, cfg.o_groups * cfg.o_lora_rank), "self_attn.sinks": (H,),
        "mlp.gate.weight": (E, D),
    }
    if inter:
        s.update({"mlp.shared_experts.gate_proj.weight": (inter, D),
                  "mlp.shared_experts.up_proj.weight": (inter, D),
                  "mlp.shared_experts.down_proj.weight": (D, inter)})
    if hashed:
        s["mlp.gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
    else:
        s["mlp.gate.e_score_correction_bias"] = (E,)
    if kind in (CSA, HCA):
        c = 2 if kind == CSA else 1
        s.update({f"self_attn.compressor.{k}": v
                  for k, v in _compressor_shapes(D, c * d, m, d).items()})
    if kind == CSA:
        k_dim = cfg.index_head_dim
        s.update({f"self_attn.compressor.indexer.{k}": v
                  for k, v in _compressor_shapes(D, 2 * k_dim, m, k_dim).items()})
        s["self_attn.compressor.indexer.q_b_proj.weight"] = (cfg.index_n_heads * k_dim,
                                                             cfg.q_lora_rank)
        s["self_attn.compressor.indexer.scorer.weights_proj.weight"] = (cfg.index_n_heads, D)
    return s


def _compressor_shapes(D: int, width: int, m: int, d: int) -> dict[str, tuple[int, ...]]:
    return {"kv_proj.weight": (width, D), "gate_proj.weight": (width, D),
            "position_bias": (m, width), "kv_norm.weight": (d,)}


HYBRID_RE = re.compile(r"^model\.layers\.\d+\.(attn|ffn)\.")
HYBRID_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
              "model.hc_head.hc_scale": "hc_head_scale"}


def unhybrid(stored: dict) -> dict:
    """Official names for transformers' default `save_pretrained()` output (docs/MODEL.md, Weights).

    That layout keeps the `model.` prefix and a few HF top-level names around official layer
    names, and calls the attention kv_norm `attn.norm`; users get it unless they pass
    save_original_format=False, so it loads too.
    """
    if not any(HYBRID_RE.match(k) for k in stored):
        return stored
    out = {}
    for name, t in stored.items():
        name = HYBRID_TOP.get(name, name.removeprefix("model."))
        out[re.sub(r"^(layers\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight", name)] = t
    return out


def official_named(stored: dict) -> dict[str, StoredTensor]:
    """The tensors of an official checkpoint that the model reads, under their HF names."""
    named = {}
    for name, t in stored.items():
        hf = hf_name(name)
        if hf is not None:
            named[hf] = t
    return named


def official_of(hf: str) -> str:
    """The official name of an HF tensor name (itself when it has none)."""
    for off, name in OFFICIAL_TOP.items():
        if name == hf:
            return off
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    if m and m.group(2) in HF_TO_OFFICIAL_LAYER:
        return f"layers.{m.group(1)}.{HF_TO_OFFICIAL_LAYER[m.group(2)]}"
    return hf
