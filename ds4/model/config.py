"""ModelConfig: a model directory's config.json (HF DeepseekV4 fields and the official keys)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
ROPE_TYPES = ("default", "yarn")

# Names the official inference code uses for the same quantities (its own config.json).
OFFICIAL_ALIASES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "route_scale": "routed_scaling_factor",
    "score_func": "scoring_func",
    "window_size": "sliding_window",
    "norm_eps": "rms_norm_eps",
    "rope_head_dim": "qk_rope_head_dim",
}


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: base, optional YaRN scaling and the cos/sin magnitude factor."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Every model hyper-parameter the engine reads; nothing comes from Flash defaults."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_main: RopeSpec
    rope_compress: RopeSpec
    rms_norm_eps: float
    max_position_embeddings: int
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    quantization_config: dict | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    def compress_ratio(self, layer: int) -> int:
        """Tokens per compressed entry in a layer (0 for sliding-only layers)."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else int(self.compress_rates[kind])

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read <model_dir>/config.json."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """Build from a config.json dict; an invalid or unsupported field raises ValueError."""
        return _parse(dict(data))


def _require(data: dict, name: str):
    if name not in data or data[name] is None:
        raise ValueError(f"config.json lacks required field {name!r}")
    return data[name]


def _int(data: dict, name: str, minimum: int = 1) -> int:
    value = _require(data, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"config field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(data: dict, name: str, default: float | None = None) -> float:
    value = data.get(name, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config field {name!r} must be a number, got {value!r}")
    return float(value)


def _parse(data: dict) -> ModelConfig:
    for official, hf in OFFICIAL_ALIASES.items():
        if official in data and hf not in data:
            data[hf] = data[official]
    main, compress = _rope_specs(data)
    return ModelConfig(
        vocab_size=_int(data, "vocab_size"),
        hidden_size=_int(data, "hidden_size"),
        num_hidden_layers=_int(data, "num_hidden_layers"),
        **_attention_fields(data),
        **_moe_fields(data),
        **_compression_fields(data),
        hc_mult=_int(data, "hc_mult"),
        hc_sinkhorn_iters=_int(data, "hc_sinkhorn_iters"),
        hc_eps=_float(data, "hc_eps"),
        rope_main=main,
        rope_compress=compress,
        rms_norm_eps=_float(data, "rms_norm_eps", 1e-6),
        max_position_embeddings=_int(data, "max_position_embeddings"),
        num_nextn_predict_layers=int(data.get("num_nextn_predict_layers") or 0),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        bos_token_id=int(data.get("bos_token_id") or 0),
        eos_token_id=_eos(data.get("eos_token_id", 1)),
        quantization_config=data.get("quantization_config"),
        raw=data,
    )


def _attention_fields(data: dict) -> dict:
    if data.get("num_key_value_heads", 1) != 1:
        raise ValueError("config field 'num_key_value_heads' must be 1 (one shared K=V head)")
    head_dim = _int(data, "head_dim")
    heads, groups = _int(data, "num_attention_heads"), _int(data, "o_groups")
    if heads % groups:
        raise ValueError(f"config field 'o_groups' ({groups}) must divide "
                         f"num_attention_heads ({heads})")
    return dict(num_attention_heads=heads, head_dim=head_dim,
                qk_rope_head_dim=_rope_dim(data, head_dim),
                q_lora_rank=_int(data, "q_lora_rank"), o_groups=groups,
                o_lora_rank=_int(data, "o_lora_rank"),
                sliding_window=_int(data, "sliding_window"))


def _moe_fields(data: dict) -> dict:
    n = _int(data, "num_hidden_layers")
    scoring = data.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"config field 'scoring_func' must be one of {SCORING_FUNCS}, "
                         f"got {scoring!r}")
    topk, experts = _int(data, "num_experts_per_tok"), _int(data, "n_routed_experts")
    if topk > experts:
        raise ValueError(f"config field 'num_experts_per_tok' ({topk}) exceeds "
                         f"n_routed_experts ({experts})")
    return dict(
        n_routed_experts=experts, num_experts_per_tok=topk,
        n_shared_experts=_int(data, "n_shared_experts", 0) if "n_shared_experts" in data else 1,
        moe_intermediate_size=_int(data, "moe_intermediate_size"), scoring_func=scoring,
        norm_topk_prob=bool(data.get("norm_topk_prob", True)),
        routed_scaling_factor=_float(data, "routed_scaling_factor"),
        swiglu_limit=_float(data, "swiglu_limit"), mlp_layer_types=_mlp_layer_types(data, n),
    )


def _compression_fields(data: dict) -> dict:
    n = _int(data, "num_hidden_layers")
    rates = _compress_rates(data)
    layer_types = _layer_types(data, n, rates)
    has_csa = CSA in layer_types
    return dict(
        layer_types=layer_types, compress_rates=rates,
        index_n_heads=(_int(data, "index_n_heads") if has_csa
                       else int(data.get("index_n_heads") or 1)),
        index_head_dim=_index_head_dim(data, layer_types, _rope_dim(data, _int(data, "head_dim"))),
        index_topk=_int(data, "index_topk") if has_csa else int(data.get("index_topk") or 1),
    )


def _eos(value) -> int:
    if isinstance(value, list):
        value = value[0] if value else 1
    return int(value if value is not None else 1)


def _rope_dim(data: dict, head_dim: int) -> int:
    if data.get("qk_rope_head_dim") is not None:
        rope_dim = _int(data, "qk_rope_head_dim")
    else:
        factor = _float(data, "partial_rotary_factor", 64 / 512)
        rope_dim = int(head_dim * factor)
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ValueError("config field 'qk_rope_head_dim' must be even and in (0, head_dim], "
                         f"got {rope_dim}")
    return rope_dim


def _index_head_dim(data: dict, layer_types: tuple, rope_dim: int) -> int:
    if CSA not in layer_types:
        return int(data.get("index_head_dim", rope_dim))
    dim = _int(data, "index_head_dim")
    if dim < rope_dim:
        raise ValueError(f"config field 'index_head_dim' ({dim}) is smaller than the rope dim "
                         f"({rope_dim})")
    return dim


def _compress_rates(data: dict) -> dict:
    rates = dict(data.get("compress_rates") or _rates_of_ratios(data.get("compress_ratios")))
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if data.get(legacy) is not None:
            rates[kind] = data[legacy]
    for kind, rate in rates.items():
        if (kind not in (CSA, HCA) or isinstance(rate, bool) or not isinstance(rate, int)
                or rate < 1):
            raise ValueError(f"config field 'compress_rates' has an invalid entry {kind!r}: "
                             f"{rate!r}")
    return rates


def _rates_of_ratios(ratios) -> dict:
    """Official rule: ratio 4 is CSA (overlap + indexer), any other non-zero ratio is HCA."""
    rates = {CSA: 4, HCA: 128}
    others = {r for r in ratios or () if r not in (0, 4)}
    if len(others) > 1:
        raise ValueError(f"config field 'compress_ratios' mixes HCA ratios {sorted(others)}")
    if others:
        rates[HCA] = others.pop()
    return rates


def _layer_types(data: dict, n: int, rates: dict) -> tuple[str, ...]:
    ratios = data.get("compress_ratios")
    from_ratios = None
    if ratios is not None:
        from_ratios = [_type_of_ratio(r, rates) for r in list(ratios)[:n]]
    types = data.get("layer_types")
    if types is None:
        if from_ratios is None:
            raise ValueError("config.json lacks 'layer_types' and 'compress_ratios'; the layer "
                             "schedule must come from the checkpoint")
        types = from_ratios
    types = list(types)[:n]
    if len(types) != n:
        raise ValueError(f"config field 'layer_types' has {len(types)} entries for {n} layers")
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise ValueError(f"config field 'layer_types' has unsupported entries {bad}")
    if from_ratios is not None and from_ratios != types:
        raise ValueError("config fields 'layer_types' and 'compress_ratios' disagree")
    return tuple(types)


def _type_of_ratio(ratio, rates: dict) -> str:
    if ratio == 0:
        return SLIDING
    if ratio == rates.get(CSA):
        return CSA
    if ratio == rates.get(HCA):
        return HCA
    raise ValueError(f"config field 'compress_ratios' has ratio {ratio!r}, which matches no "
                     f"compress rate {rates}")


def _mlp_layer_types(data: dict, n: int) -> tuple[str, ...]:
    types = data.get("mlp_layer_types")
    if types is None:
        n_hash = data.get("num_hash_layers")
        if n_hash is None:
            raise ValueError("config.json lacks 'mlp_layer_types' and 'num_hash_layers'")
        if isinstance(n_hash, bool) or not isinstance(n_hash, int) or n_hash < 0:
            raise ValueError("config field 'num_hash_layers' must be an integer >= 0, "
                             f"got {n_hash!r}")
        types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    types = list(types)[:n]
    if len(types) != n or any(t not in MLP_TYPES for t in types):
        raise ValueError(f"config field 'mlp_layer_types' must hold {n} entries from {MLP_TYPES}")
    if (data.get("num_hash_layers") is not None
            and data["num_hash_layers"] != types.count("hash_moe")):
        raise ValueError("config fields 'mlp_layer_types' and 'num_hash_layers' disagree")
    return tuple(types)


def _rope_specs(data: dict) -> tuple[RopeSpec, RopeSpec]:
    params = data.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return _rope_spec(params["main"], "main"), _rope_spec(params["compress"], "compress")
    scaling = {k: v for k, v in params.items() if k not in ("main", "compress")}
    scaling = scaling or dict(data.get("rope_scaling") or {})
    main = {"rope_type": "default", "rope_theta": _float(data, "rope_theta", 10000.0)}
    compress = {**scaling, "rope_theta": _float(data, "compress_rope_theta", 160000.0)}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)  # V4 applies no YaRN magnitude to cos/sin
    return _rope_spec(main, "main"), _rope_spec(compress, "compress")


def _rope_spec(params: dict, label: str) -> RopeSpec:
    kind = params.get("rope_type", params.get("type", "default"))
    where = f"rope_parameters[{label!r}]"
    if kind not in ROPE_TYPES:
        raise ValueError(f"config field {where}.rope_type {kind!r} is not supported ({ROPE_TYPES})")
    theta = params.get("rope_theta")
    if not isinstance(theta, (int, float)) or theta <= 1:
        raise ValueError(f"config field {where}.rope_theta must be a number > 1, got {theta!r}")
    if kind == "default":
        return RopeSpec(theta=float(theta))
    factor = float(params.get("factor") or 0)
    original = params.get("original_max_position_embeddings")
    if factor <= 0 or not isinstance(original, int) or original <= 0:
        raise ValueError(f"config field {where} needs yarn 'factor' and "
                         "'original_max_position_embeddings'")
    attention = params.get("attention_factor")
    if attention is None:
        attention = _yarn_mscale(factor, params.get("mscale"), params.get("mscale_all_dim"))
    return RopeSpec(
        theta=float(theta), rope_type="yarn", factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)), attention_factor=float(attention),
    )


def _yarn_mscale(factor: float, mscale, mscale_all_dim) -> float:
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)
