"""The built-in tiny model: a deterministic, complete V4 checkpoint made on demand."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4.engine import default_model_dir, make_tiny
from ds4.tokenizer import Tokenizer


def header(path: Path) -> dict:
    """The JSON header of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"))


def test_config_has_every_layer_type_hash_layers_and_mtp(tiny: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert config["vocab_size"] == 129280
    types = config["layer_types"]
    assert types[:2] == ["sliding_attention"] * 2
    assert {"compressed_sparse_attention", "heavily_compressed_attention"} <= set(types[2:])
    assert "hash_moe" in config["mlp_layer_types"] and "moe" in config["mlp_layer_types"]
    assert config["num_hash_layers"] == config["mlp_layer_types"].count("hash_moe")
    assert len(config["compress_ratios"]) == config["num_hidden_layers"] + 1  # + MTP
    assert config["num_nextn_predict_layers"] == 1
    # a 300-token prompt gives 75 CSA rows; the indexer must choose among them
    assert config["index_topk"] < 300 // config["compress_rates"]["compressed_sparse_attention"]


def test_tensors_use_hf_names_bf16_and_official_mtp_names(tiny: Path) -> None:
    tensors = header(tiny / "model.safetensors")
    tensors.pop("__metadata__")
    config = json.loads((tiny / "config.json").read_text())
    D, V = config["hidden_size"], config["vocab_size"]
    assert tensors["model.embed_tokens.weight"]["shape"] == [V, D]
    assert tensors["lm_head.weight"]["shape"] == [V, D]
    assert tensors["model.layers.2.self_attn.compressor.indexer.q_b_proj.weight"]["dtype"] == "BF16"
    tid2eid = tensors["model.layers.0.mlp.gate.tid2eid"]
    assert (tid2eid["dtype"], tid2eid["shape"]) == ("I64", [V, config["num_experts_per_tok"]])
    assert "model.layers.3.self_attn.compressor.position_bias" in tensors
    assert "model.layers.3.self_attn.compressor.indexer.kv_proj.weight" not in tensors  # HCA
    assert "model.layers.5.mlp.gate.e_score_correction_bias" in tensors
    for name in ["mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight",
                 "mtp.0.hnorm.weight",
                 "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight",
                 "mtp.0.hc_attn_fn", "mtp.0.ffn.gate.bias", "mtp.0.ffn.experts.7.w2.weight",
                 "mtp.0.ffn.shared_experts.w1.weight"]:
        assert name in tensors, name
    assert not any(k.startswith("mtp.0.attn.compressor") for k in tensors)  # MTP is a sliding block
    assert Tokenizer.for_model(tiny).encode("Hello") == Tokenizer.for_model(None).encode("Hello")


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path, tiny: Path) -> None:
    again = make_tiny(tmp_path / "again")
    other = make_tiny(tmp_path / "other", seed=1)
    weights = (tiny / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights


def test_default_model_dir_is_made_once_even_by_racing_processes(tmp_path: Path,
                                                                 monkeypatch) -> None:
    monkeypatch.setenv("DS4_CACHE_DIR", str(tmp_path))
    code = "from ds4.engine import default_model_dir; print(default_model_dir())"
    env = {**os.environ, "DS4_CACHE_DIR": str(tmp_path)}
    racers = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                               text=True)
              for _ in range(3)]
    paths = {p.communicate(timeout=120)[0].strip() for p in racers}
    assert all(p.returncode == 0 for p in racers)
    assert len(paths) == 1
    made = Path(paths.pop())
    assert made.parent == tmp_path and (made / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [made.name]  # no half-built leftovers
    stamp = (made / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == made
    assert (made / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten


def test_engine_runs_the_tiny_model_to_varied_greedy_tokens(tiny: Path) -> None:
    from ds4.engine import Engine

    engine = Engine.open(tiny, backend="numpy")
    assert engine.config.vocab_size == 129280
    session = engine.new_session(ctx_size=512)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 30)[:300]
    logits = session.sync(prompt)
    out = []
    for _ in range(24):
        token = int(np.argmax(logits))
        out.append(token)
        logits = session.decode(token)
    assert np.isfinite(logits).all()
    assert len(set(out)) >= 12, out  # random weights, but not stuck on one token
