"""Model weights: every checkpoint layout mapped to HF names, checked (docs/MODEL.md, Weights)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np

from ds4.kernels import exact_bf16, widen
from ds4.model.config import CSA, HCA, ModelConfig
from ds4.model.safetensors_file import StoredTensor, read_checkpoint

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
HF_TO_OFFICIAL_LAYER.update({hf + ".weight": off + ".weight" for off, hf in OFFICIAL_LAYER_MODULES.items()})
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
        "model.hc_head.hc_fn": (hc, hc * D), "model.hc_head.hc_base": (hc,), "model.hc_head.hc_scale": (1,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in _layer_shapes(cfg, i, mix).items()})
    return shapes


def _layer_shapes(cfg: ModelConfig, i: int, mix: int) -> dict[str, tuple[int, ...]]:
    D, H, d, E = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.n_routed_experts
    inter = cfg.moe_intermediate_size * cfg.n_shared_experts
    s = {
        "attn_hc.fn": (mix, cfg.hc_mult * D), "attn_hc.base": (mix,), "attn_hc.scale": (3,),
        "ffn_hc.fn": (mix, cfg.hc_mult * D), "ffn_hc.base": (mix,), "ffn_hc.scale": (3,),
        "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
        "self_attn.q_a_proj.weight": (cfg.q_lora_rank, D), "self_attn.q_a_norm.weight": (cfg.q_lora_rank,),
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
    if cfg.mlp_layer_types[i] == "hash_moe":
        s["mlp.gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
    else:
        s["mlp.gate.e_score_correction_bias"] = (E,)
    kind, m = cfg.layer_types[i], cfg.compress_ratio(i)
    if kind in (CSA, HCA):
        c = 2 if kind == CSA else 1
        s.update({f"self_attn.compressor.{k}": v for k, v in _compressor_shapes(D, c * d, m, d).items()})
    if kind == CSA:
        k_dim = cfg.index_head_dim
        s.update({f"self_attn.compressor.indexer.{k}": v
                  for k, v in _compressor_shapes(D, 2 * k_dim, m, k_dim).items()})
        s["self_attn.compressor.indexer.q_b_proj.weight"] = (cfg.index_n_heads * k_dim, cfg.q_lora_rank)
        s["self_attn.compressor.indexer.scorer.weights_proj.weight"] = (cfg.index_n_heads, D)
    return s


def _compressor_shapes(D: int, width: int, m: int, d: int) -> dict[str, tuple[int, ...]]:
    return {"kv_proj.weight": (width, D), "gate_proj.weight": (width, D),
            "position_bias": (m, width), "kv_norm.weight": (d,)}


class ExpertBank:
    """One layer's routed experts: stacks resident on the device, or mapped views widened per use.

    Resident stacks hold bf16 words (uint16) when every value is exactly bf16 (any bf16, FP8
    or FP4 checkpoint): half the bytes of fp32 and the same numbers. On the GPU the decode
    kernels and the prefill GEMMs read these stacks in place, so every expert is in device
    memory once; the NumPy path widens the experts a chunk uses.
    """

    def __init__(self, xp, gate_up: list, down: list, resident: bool):
        self.xp = xp
        self.resident = resident
        self.count = len(down)
        if resident:
            self._gate_up = xp.asarray(_stack(gate_up))
            self._down = xp.asarray(_stack(down))
        else:
            self._gate_up_src, self._down_src = gate_up, down

    @property
    def stacked(self) -> tuple | None:
        """(gate_up [E, 2I, D], down [E, D, I]) as held (bf16 words or fp32); None when streamed."""
        return (self._gate_up, self._down) if self.resident else None

    @property
    def nbytes(self) -> int:
        """Bytes held resident (0 when streamed from the mapped file)."""
        return int(self._gate_up.nbytes + self._down.nbytes) if self.resident else 0

    def gather(self, ids) -> tuple:
        """(gate_up [k, 2I, D], down [k, D, I]) fp32 for expert ids [k] (streaming reads them on host)."""
        if self.resident:
            return widen(self._gate_up[ids], self.xp), widen(self._down[ids], self.xp)
        ids = (ids.get() if hasattr(ids, "get") else np.asarray(ids)).tolist()
        gate_up = np.stack([_widen_source(self._gate_up_src[e]) for e in ids])
        down = np.stack([_widen_source(self._down_src[e]) for e in ids])
        return self.xp.asarray(gate_up), self.xp.asarray(down)

    def expert(self, e: int) -> tuple:
        """(gate_up [2I, D], down [D, I]) fp32 of one expert."""
        if self.resident:
            return widen(self._gate_up[e], self.xp), widen(self._down[e], self.xp)
        return (self.xp.asarray(_widen_source(self._gate_up_src[e])),
                self.xp.asarray(_widen_source(self._down_src[e])))


def _widen_source(src) -> np.ndarray:
    """A source is a (StoredTensor, row) slice of a stacked tensor or a tuple of parts to concat."""
    if len(src) == 2 and isinstance(src[1], int):
        return src[0].widen(src[1])
    return np.concatenate([part.widen() for part in src], axis=0)


def _stack(sources: list) -> np.ndarray:
    """The experts stacked as bf16 words when every value is exactly bf16, else as fp32."""
    first = _widen_source(sources[0])
    words = np.empty((len(sources), *first.shape), dtype=np.uint16)
    for e in range(len(sources)):
        exact = exact_bf16(first if e == 0 else _widen_source(sources[e]))
        if exact is None:
            return np.stack([_widen_source(s) for s in sources]).astype(np.float32, copy=False)
        words[e] = exact
    return words


class WeightsError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape."""


class Weights:
    """Named device arrays (HF names; GPU matrices as bf16 words), expert banks, MTP kept aside."""

    def __init__(self, tensors: dict, experts: list, mtp: dict, low_precision: bool):
        self.tensors = tensors
        self.experts = experts
        self.mtp = mtp  # official `mtp.*` tensors, mapped but unused (no MTP inference here)
        self.low_precision = low_precision

    def __getitem__(self, name: str):
        return self.tensors[name]

    def layer(self, i: int) -> "LayerWeights":
        """Accessor for one decoder layer's tensors by their names inside the layer."""
        return LayerWeights(self, i)

    @property
    def nbytes(self) -> int:
        """Bytes of resident weights (tied tensors counted once)."""
        seen = {id(t): int(t.nbytes) for t in self.tensors.values()}
        return sum(seen.values()) + sum(bank.nbytes for bank in self.experts)


class LayerWeights:
    """`lw["self_attn.kv_proj.weight"]` for layer i, plus its expert bank."""

    def __init__(self, weights: Weights, i: int):
        self._tensors = weights.tensors
        self._prefix = f"model.layers.{i}."
        self.experts = weights.experts[i]

    def __getitem__(self, name: str):
        return self._tensors[self._prefix + name]

    def __contains__(self, name: str) -> bool:
        return self._prefix + name in self._tensors


def load_weights(model_dir: str | Path, cfg: ModelConfig, xp, resident_experts: bool = True) -> Weights:
    """Map, check and widen a checkpoint; routed experts stay mapped when not resident."""
    stored = _unhybrid(read_checkpoint(model_dir))
    mtp = {k: v for k, v in stored.items() if k.startswith("mtp.")}
    official = not any(k.startswith(("model.", "lm_head.")) for k in stored)
    named = _official_named(stored) if official else {k: v for k, v in stored.items() if k not in mtp}
    expected = expected_shapes(cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" in named:
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for name, shape in expected.items():
        _check(named, name, shape, official)
    expert_sources = [_expert_sources(stored if official else named, cfg, i, official)
                      for i in range(cfg.num_hidden_layers)]
    expert_bytes = sum(_source_bytes(s) for pair in expert_sources for part in pair for s in part)
    progress = _progress(sum(named[n].nbytes for n in expected) + (expert_bytes if resident_experts else 0))
    tensors = {}
    for name in expected:
        tensors[name] = _device_tensor(xp, name, named[name])
        progress.update(named[name].nbytes)
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    experts = []
    for gate_up, down in expert_sources:
        experts.append(ExpertBank(xp, gate_up, down, resident_experts))
        progress.update(sum(_source_bytes(s) for s in gate_up + down) if resident_experts else 0)
    progress.close()
    low = any(t.is_low_precision for t in stored.values())
    return Weights(tensors, experts, mtp, low)


WORD_MATRICES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")


def _device_tensor(xp, name: str, stored: StoredTensor):
    """A GPU matrix of exact bf16 values as bf16 words (kernels and GEMMs read them); else fp32."""
    # held once in the form both decode kernels and GemmEx read; NumPy keeps fp32, which its
    # matmul reads fastest
    if xp is not np and name.endswith(WORD_MATRICES):
        if stored.dtype == "BF16":  # already the words: no fp32 copy to narrow again
            return xp.asarray(stored.data)
        words = exact_bf16(stored.widen())
        if words is not None:
            return xp.asarray(words)
    return xp.asarray(stored.widen())


HYBRID_RE = re.compile(r"^model\.layers\.\d+\.(attn|ffn)\.")
HYBRID_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
              "model.hc_head.hc_scale": "hc_head_scale"}


def _unhybrid(stored: dict) -> dict:
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


def _official_named(stored: dict) -> dict[str, StoredTensor]:
    named = {}
    for name, t in stored.items():
        hf = hf_name(name)
        if hf is not None:
            named[hf] = t
    return named


def _official_of(hf: str) -> str:
    for off, name in OFFICIAL_TOP.items():
        if name == hf:
            return off
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    if m and m.group(2) in HF_TO_OFFICIAL_LAYER:
        return f"layers.{m.group(1)}.{HF_TO_OFFICIAL_LAYER[m.group(2)]}"
    return hf


def _check(named: dict, name: str, shape: tuple, official: bool) -> None:
    label = f"{_official_of(name)} (HF {name})" if official else name
    if name not in named:
        raise WeightsError(f"checkpoint lacks tensor {label}, expected shape {list(shape)}")
    got = named[name].shape
    if tuple(got) != tuple(shape):
        raise WeightsError(f"tensor {label} has shape {list(got)}, expected {list(shape)}")


def _expert_sources(tensors: dict, cfg: ModelConfig, i: int, official: bool) -> tuple[list, list]:
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if not official:
        stem = f"model.layers.{i}.mlp.experts."
        _check(tensors, stem + "gate_up_proj", (E, 2 * I, D), False)
        _check(tensors, stem + "down_proj", (E, D, I), False)
        gate_up, down = tensors[stem + "gate_up_proj"], tensors[stem + "down_proj"]
        return [(gate_up, e) for e in range(E)], [(down, e) for e in range(E)]
    gate_up, down = [], []
    for e in range(E):
        stem = f"layers.{i}.ffn.experts.{e}."
        for part, shape in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            _check(tensors, f"{stem}{part}.weight", shape, False)
        gate_up.append((tensors[stem + "w1.weight"], tensors[stem + "w3.weight"]))
        down.append((tensors[stem + "w2.weight"],))
    return gate_up, down


def _source_bytes(src) -> int:
    if len(src) == 2 and isinstance(src[1], int):
        return src[0].nbytes // src[0].data.shape[0]
    return sum(part.nbytes for part in src)


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int):
    """A stderr progress bar for checkpoints over 256 MiB; silent for small models."""
    if total < 256 << 20:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", file=sys.stderr)
