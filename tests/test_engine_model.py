"""A small random DeepSeek-V4 model written in the HF layout, for the engine tests.

Also tests config and weight-loading errors (they need a model directory to break).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ds4.model.checkpoint_names import expected_shapes
from ds4.model.config import CSA, HCA, SLIDING, ModelConfig
from ds4.model.weights import WeightsError, load_weights

SMALL = dict(
    vocab_size=300, hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0,
    layer_types=[SLIDING, CSA, HCA, CSA, HCA], mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 3,
    compress_rates={CSA: 4, HCA: 8}, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, sliding_window=8,
    index_n_heads=4, index_head_dim=16, index_topk=3, rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    rms_norm_eps=1e-6, max_position_embeddings=1 << 20, tie_word_embeddings=False,
)


def random_tensor(name: str, shape: tuple, rng: np.random.Generator,
                  cfg: ModelConfig) -> np.ndarray:
    """Values scaled like the reference fixtures: unit-ish activations, non-flat softmaxes."""
    if name.endswith("tid2eid"):
        return np.stack([rng.permutation(cfg.n_routed_experts)[: shape[1]]
                         for _ in range(shape[0])])
    normal = rng.standard_normal(shape).astype(np.float32)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0 + 0.2 * normal
    if name.endswith("scale"):
        return (0.6 + 0.8 * rng.random(shape)).astype(np.float32)
    if name.endswith(("base", "position_bias", "sinks")):
        return 0.5 * normal
    if name.endswith(("fn", "e_score_correction_bias")):
        return 0.1 * normal
    if name.endswith("embed_tokens.weight"):
        return normal
    return normal / np.sqrt(shape[-1])


def write_model(directory: Path, seed: int = 0, **overrides) -> Path:
    """Write config.json + model.safetensors (HF names, fp32) of a random model;
    returns directory."""
    data = {**SMALL, **overrides}
    cfg = ModelConfig.from_dict(data)
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(cfg)
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        shapes[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (E, 2 * I, D)
        shapes[f"model.layers.{i}.mlp.experts.down_proj"] = (E, D, I)
    tensors = {name: np.ascontiguousarray(random_tensor(name, shape, rng, cfg))
               for name, shape in shapes.items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(data))
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("small"))


def _config_error(**changes) -> str:
    data = {**SMALL, **changes}
    for key in [k for k, v in changes.items() if v is None]:
        data.pop(key)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(data)
    return str(err.value)


def test_config_errors_name_the_field():
    assert "layer_types" in _config_error(layer_types=[SLIDING, "full_attention", HCA, CSA, HCA])
    assert "layer_types" in _config_error(layer_types=[SLIDING, CSA])
    assert "compress_ratios" in _config_error(layer_types=None, compress_ratios=[0, 4, 8, 4, 7, 0])
    assert "scoring_func" in _config_error(scoring_func="relu")
    assert "num_key_value_heads" in _config_error(num_key_value_heads=4)
    assert "hidden_size" in _config_error(hidden_size=None)
    assert "o_groups" in _config_error(o_groups=3)
    assert "rope_type" in _config_error(rope_parameters={"rope_type": "longrope", "factor": 2.0})
    assert "mlp_layer_types" in _config_error(mlp_layer_types=["hash_moe", "dense"] + ["moe"] * 3)
    assert "swiglu_limit" in _config_error(swiglu_limit=None)  # no silent Flash default
    assert "disagree" in _config_error(compress_ratios=[0, 4, 8, 8, 8, 0])


def test_schedule_comes_from_official_keys():
    data = {k: v for k, v in SMALL.items()
            if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
    cfg = ModelConfig.from_dict({**data, "compress_ratios": [0, 4, 8, 4, 8, 0],
                                 "num_hash_layers": 1,
                                 "rope_parameters": None,
                                 "rope_scaling": {"type": "yarn", "factor": 16.0, "beta_fast": 32,
                                                  "beta_slow": 1,
                                                  "original_max_position_embeddings": 65536}})
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA, HCA)  # trailing MTP ratio dropped
    assert cfg.compress_rates[HCA] == 8 and cfg.compress_ratio(2) == 8
    assert cfg.mlp_layer_types == ("hash_moe",) + ("moe",) * 4
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.attention_factor == 1.0
    assert cfg.rope_main.rope_type == "default" and cfg.rope_main.theta == 10000.0


def test_missing_and_misshapen_tensors_are_named(model_dir, tmp_path):
    from safetensors.numpy import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    cfg = ModelConfig.from_dir(model_dir)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    name = "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, str(broken / "model.safetensors"))
    with pytest.raises(WeightsError, match=rf"{name}.*expected shape \[64, 16\]"):
        load_weights(broken, cfg, np)
    save_file({**tensors, name: tensors[name][:, :8].copy()}, str(broken / "model.safetensors"))
    with pytest.raises(WeightsError, match=rf"{name} has shape \[64, 8\], expected \[64, 16\]"):
        load_weights(broken, cfg, np)


def test_streamed_experts_equal_resident(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    resident = load_weights(model_dir, cfg, np, resident_experts=True)
    streamed = load_weights(model_dir, cfg, np, resident_experts=False)
    ids = np.array([3, 0, 3])
    for got, want in zip(streamed.experts[2].gather(ids), resident.experts[2].gather(ids)):
        np.testing.assert_array_equal(got, want)
    assert streamed.nbytes < resident.nbytes


def test_sharded_index_loads_like_one_file(model_dir, tmp_path):
    from safetensors.numpy import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    data = json.loads((model_dir / "config.json").read_text())
    (sharded / "config.json").write_text(json.dumps({**data,
                                                     "quantization_config": {"fmt": "e4m3"}}))
    cfg = ModelConfig.from_dir(sharded)
    one, split = load_weights(model_dir, cfg, np), load_weights(sharded, cfg, np)
    assert set(one.tensors) == set(split.tensors)
    for name in one.tensors:
        np.testing.assert_array_equal(one[name], split[name])

    from ds4.engine import Engine

    assert Engine.open(sharded, backend="numpy").model.quantize  # quantization_config turns it on
    assert not Engine.open(model_dir, backend="numpy").model.quantize


def test_bf16_experts_are_held_once_as_bf16_words(model_dir, tmp_path):
    """A checkpoint whose experts are exactly bf16 keeps them as 16-bit words (half the bytes)
    that the decode kernels read in place; the model code still sees the same fp32 values.
    An fp32 checkpoint with values bf16 cannot hold stays fp32."""
    from safetensors.numpy import load_file

    from ds4.kernels import to_bf16, widen
    from ds4.model.gpu_weights import layer_tensors

    tensors = load_file(str(model_dir / "model.safetensors"))
    rounded = {k: widen(to_bf16(v)) if v.dtype.kind == "f" else v for k, v in tensors.items()}
    bf16_dir = tmp_path / "bf16"
    bf16_dir.mkdir()
    save_file(rounded, str(bf16_dir / "model.safetensors"))
    (bf16_dir / "config.json").write_text((model_dir / "config.json").read_text())
    cfg = ModelConfig.from_dir(model_dir)
    exact, plain = load_weights(bf16_dir, cfg, np), load_weights(model_dir, cfg, np)
    bank = exact.experts[1]
    assert [w.dtype for w in bank.stacked] == [np.uint16, np.uint16]
    assert [w.dtype for w in plain.experts[1].stacked] == [np.float32, np.float32]
    assert 2 * bank.nbytes == plain.experts[1].nbytes
    gate_up, down = bank.gather(np.array([2, 0]))
    np.testing.assert_array_equal(gate_up,
                                  rounded["model.layers.1.mlp.experts.gate_up_proj"][[2, 0]])
    np.testing.assert_array_equal(down, rounded["model.layers.1.mlp.experts.down_proj"][[2, 0]])
    t = layer_tensors(np, cfg, exact, 1)
    assert t["experts.gate_up"] is bank.stacked[0] and t["experts.down"] is bank.stacked[1]
