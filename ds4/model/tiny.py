"""The built-in tiny model: a deterministic random DeepSeek-V4 checkpoint with the real vocabulary.

It has every layer type (2 sliding, then CSA and HCA alternating), hash-routed MoE layers, an
indexer whose top-k is smaller than the compressed rows of a few-hundred-token prompt, and an
MTP block under the official `mtp.0.*` names (docs/MODEL.md, MTP block). Weights are stored as bf16
in transformers' `save_original_format=False` layout, so it loads like a real checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from ds4.kernels import to_bf16
from ds4.model.checkpoint_names import HF_TO_OFFICIAL_LAYER
from ds4.model.config import CSA, HCA, SLIDING

TINY_VERSION = "1"  # bump when the recipe below changes: cached copies are then regenerated
LAYER_TYPES = [SLIDING, SLIDING, CSA, HCA, CSA, HCA]
NUM_HASH_LAYERS = 3
RATES = {SLIDING: 0, CSA: 4, HCA: 32}
YARN = {"factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 64,
    "num_hidden_layers": len(LAYER_TYPES),
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 8,
    "partial_rotary_factor": 0.125,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "sliding_window": 64,
    "layer_types": LAYER_TYPES,
    "mlp_layer_types": (["hash_moe"] * NUM_HASH_LAYERS
                        + ["moe"] * (len(LAYER_TYPES) - NUM_HASH_LAYERS)),
    "compress_rates": {CSA: RATES[CSA], HCA: RATES[HCA]},
    "compress_ratios": [RATES[t] for t in LAYER_TYPES] + [0],  # official key, + the MTP block
    "num_hash_layers": NUM_HASH_LAYERS,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 16,  # a 300-token prompt has 75 CSA rows
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", **YARN},
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
        "compress": {"rope_type": "yarn", **YARN, "attention_factor": 1.0,
                     "rope_theta": 160000.0, "partial_rotary_factor": 0.125},
    },
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}


def block_tensors(c: dict, kind: str, hash_moe: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF-named tensors of one decoder layer: suffix -> (shape, init rule)."""
    d, h, D, hc = c["head_dim"], c["num_attention_heads"], c["hidden_size"], c["hc_mult"]
    q, og, ol = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    e, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    mix = (2 + hc) * hc
    t = {
        "attn_hc.fn": ((mix, hc * D), "hc_fn"), "attn_hc.base": ((mix,), "base"),
        "attn_hc.scale": ((3,), "scale"),
        "ffn_hc.fn": ((mix, hc * D), "hc_fn"), "ffn_hc.base": ((mix,), "base"),
        "ffn_hc.scale": ((3,), "scale"),
        "input_layernorm.weight": ((D,), "norm"), "post_attention_layernorm.weight": ((D,), "norm"),
        "self_attn.q_a_proj.weight": ((q, D),
                                      "linear"), "self_attn.q_a_norm.weight": ((q,), "norm"),
        "self_attn.q_b_proj.weight": ((h * d, q), "linear"),
        "self_attn.kv_proj.weight": ((d, D), "linear"), "self_attn.kv_norm.weight": ((d,), "norm"),
        "self_attn.o_a_proj.weight": ((og * ol, h * d // og), "linear"),
        "self_attn.o_b_proj.weight": ((D, og * ol), "linear"),
        "self_attn.sinks": ((h,), "sinks"),
        "mlp.gate.weight": ((e, D), "linear"),
        "mlp.experts.gate_up_proj": ((e, 2 * inter, D), "linear"),
        "mlp.experts.down_proj": ((e, D, inter), "linear"),
        "mlp.shared_experts.gate_proj.weight": ((inter, D), "linear"),
        "mlp.shared_experts.up_proj.weight": ((inter, D), "linear"),
        "mlp.shared_experts.down_proj.weight": ((D, inter), "linear"),
    }
    if hash_moe:  # a fixed token -> experts table replaces the biased top-k choice
        t["mlp.gate.tid2eid"] = ((c["vocab_size"], c["num_experts_per_tok"]), "tid2eid")
    else:
        t["mlp.gate.e_score_correction_bias"] = ((e,), "bias")
    if kind != SLIDING:
        t.update(compressor_tensors(c, kind))
    return t


def compressor_tensors(c: dict, kind: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF-named compressor (and, for CSA, indexer) tensors of one layer."""
    d, D, m = c["head_dim"], c["hidden_size"], RATES[kind]
    width = 2 * d if kind == CSA else d  # CSA pools two overlapping series
    pre = "self_attn.compressor."
    t = {
        pre + "kv_proj.weight": ((width, D),
                                 "linear"), pre + "gate_proj.weight": ((width, D), "linear"),
        pre + "position_bias": ((m, width),
                                "position_bias"), pre + "kv_norm.weight": ((d,), "norm"),
    }
    if kind == CSA:
        ih, idim, ix = c["index_n_heads"], c["index_head_dim"], pre + "indexer."
        t.update({
            ix + "kv_proj.weight": ((2 * idim, D),
                                    "linear"), ix + "gate_proj.weight": ((2 * idim, D), "linear"),
            ix + "position_bias": ((m, 2 * idim),
                                   "position_bias"), ix + "kv_norm.weight": ((idim,), "norm"),
            ix + "q_b_proj.weight": ((ih * idim, c["q_lora_rank"]), "linear"),
            ix + "scorer.weights_proj.weight": ((ih, D), "linear"),
        })
    return t


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], rule: str,
                  c: dict) -> np.ndarray:
    """Random values for one tensor, scaled so routing, mixing and softmaxes are not flat."""
    if rule == "tid2eid":  # distinct experts per token
        keys = rng.random((shape[0], c["n_routed_experts"]))
        return np.argsort(keys, axis=1)[:, : shape[1]].astype(np.int64)
    normal = rng.standard_normal(shape, dtype=np.float32)
    scale = {"norm": 0.2, "hc_fn": 0.1, "base": 0.5, "sinks": 1.0, "position_bias": 0.5,
             "bias": 0.1, "embed": 1.0, "scale": 0.3}
    if rule == "linear":
        return normal / np.float32(np.sqrt(shape[-1]))
    if rule in ("norm", "scale"):
        return 1.0 + scale[rule] * normal
    return scale[rule] * normal


def tiny_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of the tiny model, HF names for the main model and official `mtp.0.*`."""
    c, rng = CONFIG, np.random.default_rng(seed)
    D, V, hc = c["hidden_size"], c["vocab_size"], c["hc_mult"]
    out = {
        "model.embed_tokens.weight": random_tensor(rng, (V, D), "embed", c),
        "lm_head.weight": random_tensor(rng, (V, D), "linear", c) * np.float32(2.0),
        "model.norm.weight": random_tensor(rng, (D,), "norm", c),
        "model.hc_head.hc_fn": random_tensor(rng, (hc, hc * D), "hc_fn", c),
        "model.hc_head.hc_base": random_tensor(rng, (hc,), "base", c),
        "model.hc_head.hc_scale": random_tensor(rng, (1,), "scale", c),
    }
    for i, kind in enumerate(c["layer_types"]):
        hash_moe = c["mlp_layer_types"][i] == "hash_moe"
        for name, (shape, rule) in block_tensors(c, kind, hash_moe).items():
            out[f"model.layers.{i}.{name}"] = random_tensor(rng, shape, rule, c)
    out.update(mtp_tensors(rng, c))
    return out


def mtp_tensors(rng: np.random.Generator, c: dict) -> dict[str, np.ndarray]:
    """The MTP block: a sliding, non-hash layer plus its input projections and own HC head."""
    D, hc, inter = c["hidden_size"], c["hc_mult"], c["moe_intermediate_size"]
    out = {}
    for name, (shape, rule) in block_tensors(c, SLIDING, hash_moe=False).items():
        value = random_tensor(rng, shape, rule, c)
        if name == "mlp.experts.gate_up_proj":
            for e in range(shape[0]):
                out[f"mtp.0.ffn.experts.{e}.w1.weight"] = value[e, :inter]
                out[f"mtp.0.ffn.experts.{e}.w3.weight"] = value[e, inter:]
        elif name == "mlp.experts.down_proj":
            for e in range(shape[0]):
                out[f"mtp.0.ffn.experts.{e}.w2.weight"] = value[e]
        else:
            out["mtp.0." + HF_TO_OFFICIAL_LAYER[name]] = value
    for name, shape, rule in [("e_proj.weight", (D, D), "linear"),
                              ("h_proj.weight", (D, D), "linear"),
                              ("enorm.weight", (D,), "norm"), ("hnorm.weight", (D,), "norm"),
                              ("norm.weight", (D,), "norm"), ("hc_head_fn", (hc, hc * D), "hc_fn"),
                              ("hc_head_base", (hc,), "base"), ("hc_head_scale", (1,), "scale")]:
        out["mtp.0." + name] = random_tensor(rng, shape, rule, c)
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file with float tensors as BF16 and integer tables as I64."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        a = tensors[name]
        data, dtype = (a.astype("<i8"), "I64") if a.dtype.kind == "i" else (to_bf16(a), "BF16")
        raw = data.tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in blobs:
            f.write(raw)


def make_tiny(directory: str | Path, seed: int = 0, tokenizer_json: Path | None = None) -> Path:
    """Write the tiny model (config.json, model.safetensors, tokenizer.json) into `directory`.
    The tokenizer is the engine's to choose (`ds4.engine.make_tiny` passes the real one);
    without it the directory has none and readers fall back to the packaged one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    write_safetensors(directory / "model.safetensors", tiny_tensors(seed))
    if tokenizer_json is not None:
        shutil.copyfile(tokenizer_json, directory / "tokenizer.json")
    return directory


def default_model_dir(tokenizer_json: Path) -> Path:
    """The cached built-in tiny model ($DS4_CACHE_DIR or ~/.cache/ds4, /tiny-<version>),
    made once."""
    root = Path(os.environ.get("DS4_CACHE_DIR") or Path.home() / ".cache" / "ds4")
    target = root / f"tiny-{TINY_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # build beside the target, then one atomic rename: a concurrent process sees all or nothing
    scratch = Path(tempfile.mkdtemp(prefix=f".tiny-{TINY_VERSION}-", dir=root))
    try:
        make_tiny(scratch, tokenizer_json=tokenizer_json)
        os.rename(scratch, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
