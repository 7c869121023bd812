"""`--load-format dummy`: random weights from config.json alone, in the checkpoint's formats,
the V4-Flash config shipped in the package, and a shrunken Flash served over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from ds4.engine import Engine, default_model_dir
from ds4.model import packed as pk
from ds4.model.config import CSA, HCA, SLIDING, ModelConfig
from ds4.model.dummy import (
    CONFIG_DIR,
    dummy_weights,
    expert_bytes,
    model_path,
    shipped_configs,
)
from ds4.model.official_format import write_official
from ds4.model.tiny import CONFIG as TINY
from ds4.model.weights import load_weights

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
FLASH = json.loads((CONFIG_DIR / "deepseek-v4-flash" / "config.json").read_text())
PROMPT = [0, 3, 9, 27, 81, 243, 129, 387, 161, 483]


def shrunken_flash(layers: int = 4, experts: int = 16) -> dict:
    """The shipped Flash config with fewer layers and experts and smaller widths (the real
    vocabulary, so the packaged tokenizer fits it)."""
    c = dict(FLASH)
    c.update(num_hidden_layers=layers, compress_ratios=FLASH["compress_ratios"][:layers] + [0],
             hidden_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
             q_lora_rank=64, o_groups=2, o_lora_rank=64, n_routed_experts=experts,
             num_experts_per_tok=4, moe_intermediate_size=64, index_n_heads=4,
             index_head_dim=32, index_topk=8, sliding_window=16, num_hash_layers=1)
    return c


def small_packed(vocab: int = 512) -> dict:
    """The tiny model's config with a small vocabulary and the official FP8 / FP4 formats."""
    c = dict(TINY, vocab_size=vocab)
    c["quantization_config"] = dict(FLASH["quantization_config"], weight_block_size=[32, 32])
    c["expert_dtype"] = "fp4"
    return c


def write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def half_budget_gib(config: dict) -> float:
    """A --gpu-memory-gib that holds every dense tensor and about half of the experts (the
    embedding goes to host memory when experts do, unless the head is tied to it)."""
    weights = dummy_weights(ModelConfig.from_dict(config), np)
    experts = sum(bank.nbytes for bank in weights.experts)
    embed = weights["model.embed_tokens.weight"]
    moved = 0 if weights["lm_head.weight"] is embed else embed.nbytes
    return (weights.nbytes - moved - experts / 2) / 2**30


def logits_of(engine: Engine, prompt=PROMPT, steps=(5, 6)) -> np.ndarray:
    """Logits after the prompt and after each decoded token, stacked."""
    session = engine.new_session(256)
    out = [session.sync(prompt)]
    out += [session.decode(t) for t in steps]
    return np.stack(out)


def test_the_shipped_flash_config_has_the_official_dimensions() -> None:
    assert "deepseek-v4-flash" in shipped_configs()
    cfg = ModelConfig.from_dir(model_path("deepseek-v4-flash"))
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (43, 4096, 129280)
    assert cfg.n_routed_experts == 256 and cfg.num_experts_per_tok == 6
    assert cfg.moe_intermediate_size == 2048
    assert (cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim) == (64, 512, 64)
    assert cfg.layer_types[:2] == (SLIDING, SLIDING)
    assert cfg.layer_types.count(CSA) == 21 and cfg.layer_types.count(HCA) == 20
    assert cfg.compress_rates == {CSA: 4, HCA: 128}
    assert cfg.mlp_layer_types.count("hash_moe") == 3 and cfg.num_nextn_predict_layers == 1
    assert cfg.raw["expert_dtype"] == "fp4"
    assert cfg.quantization_config["weight_block_size"] == [128, 128]
    # one FP4 expert: 8 MiB + 4 MiB of codes, 512 + 256 KiB of scales (about 13.4 MB)
    assert expert_bytes(cfg) == 12 << 20 | 768 << 10
    assert 136 < 43 * 256 * expert_bytes(cfg) / 2**30 < 138


def test_a_real_directory_is_not_mistaken_for_a_shipped_name(tmp_path: Path) -> None:
    assert model_path(tmp_path) == tmp_path
    assert model_path("deepseek-v4-flash").parent == CONFIG_DIR


def test_same_seed_same_logits_other_seed_other_logits(tmp_path: Path) -> None:
    model = write_config(tmp_path / "m", small_packed())
    a = logits_of(Engine.open(model, backend="numpy", load_format="dummy", seed=7))
    b = logits_of(Engine.open(model, backend="numpy", load_format="dummy", seed=7))
    c = logits_of(Engine.open(model, backend="numpy", load_format="dummy", seed=8))
    assert np.isfinite(a).all() and a.std() > 0.1
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 0.1


def test_dummy_tensors_have_the_loaders_names_shapes_and_formats(tmp_path: Path) -> None:
    """A real packed checkpoint of the same config, loaded, holds the same tensors in the same
    forms (FP8 codes + E8M0 tiles, FP4 experts, BF16 words, fp32) as the dummy weights."""
    packed = write_official(default_model_dir(), tmp_path / "official", block=(32, 32))
    cfg = ModelConfig.from_dir(packed)
    real, dummy = load_weights(packed, cfg, np), dummy_weights(cfg, np, seed=0)
    assert real.tensors.keys() == dummy.tensors.keys()
    for name, held in real.tensors.items():
        fake = dummy.tensors[name]
        assert type(fake) is type(held), name
        assert fake.shape == held.shape, name
        if isinstance(held, pk.PackedMatrix):
            assert (fake.fmt, fake.block) == (held.fmt, held.block) == (pk.FP8, (32, 32)), name
            assert fake.codes.dtype == fake.scale.dtype == np.uint8, name
            assert fake.scale.shape == held.scale.shape, name
        else:
            assert fake.dtype.str[1:] == held.dtype.str[1:], name
    for bank_real, bank_fake in zip(real.experts, dummy.experts):
        for r, f in zip(bank_real.stacked, bank_fake.stacked):
            assert (f.fmt, f.shape) == (r.fmt, r.shape)
            assert (f.codes.shape, f.scale.shape) == (r.codes.shape, r.scale.shape)
            assert f.fmt == pk.FP4 and f.codes.dtype == f.scale.dtype == np.uint8


def test_dummy_values_are_sane_through_a_deep_stack(tmp_path: Path) -> None:
    """43 layers (the Flash schedule, small widths): greedy decode keeps finite logits."""
    model = write_config(tmp_path / "deep", shrunken_flash(layers=43, experts=8))
    engine = Engine.open(model, backend="numpy", load_format="dummy")
    session = engine.new_session(128)
    logits = session.sync(PROMPT)
    for _ in range(3):
        assert np.isfinite(logits).all() and 0.1 < logits.std() < 100
        logits = session.decode(int(np.argmax(logits)))


@pytest.mark.parametrize("field", ["hidden_size", "n_routed_experts", "num_hidden_layers"])
def test_a_config_missing_a_field_is_an_error_naming_it(tmp_path: Path, field: str) -> None:
    config = small_packed()
    del config[field]
    model = write_config(tmp_path / "m", config)
    with pytest.raises(ValueError, match=field):
        Engine.open(model, backend="numpy", load_format="dummy")


def test_a_bad_expert_dtype_is_named(tmp_path: Path) -> None:
    config = dict(small_packed(), expert_dtype="int3")
    with pytest.raises(ValueError, match="expert_dtype"):
        Engine.open(write_config(tmp_path / "m", config), backend="numpy", load_format="dummy")


def test_fp8_experts_when_the_config_says_so(tmp_path: Path) -> None:
    config = dict(small_packed(), expert_dtype="fp8")
    engine = Engine.open(write_config(tmp_path / "m", config), backend="numpy",
                         load_format="dummy")
    gate_up, down = engine.model.weights.experts[0].stacked
    assert gate_up.fmt == down.fmt == pk.FP8 and gate_up.codes.shape == (8, 64, 64)
    assert np.isfinite(logits_of(engine)).all()


def test_a_bad_block_size_is_named(tmp_path: Path) -> None:
    config = small_packed()
    config["quantization_config"] = dict(config["quantization_config"], weight_block_size=[32])
    with pytest.raises(ValueError, match="weight_block_size"):
        Engine.open(write_config(tmp_path / "m", config), backend="numpy", load_format="dummy")


def test_a_shipped_name_without_dummy_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="--load-format dummy"):
        Engine.open("deepseek-v4-flash", backend="numpy")


def test_ds4_generate_runs_a_dummy_model(tmp_path: Path) -> None:
    model = write_config(tmp_path / "m", shrunken_flash())
    done = subprocess.run([sys.executable, "-m", "ds4", "generate", "--model", str(model),
                           "--load-format", "dummy", "--backend", "numpy", "-p", "hi", "-n", "3"],
                          capture_output=True, text=True, env=ENV, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "decode: 3 tokens" in done.stderr or "decode: " in done.stderr


def test_a_shrunken_flash_serves_a_chat_completion(tmp_path: Path) -> None:
    model = write_config(tmp_path / "flash", shrunken_flash())
    budget = f"{half_budget_gib(shrunken_flash()):.9f}"
    proc = subprocess.Popen([sys.executable, "-m", "ds4.cli.server", "--port", "0", "--ctx", "512",
                             "--model", str(model), "--load-format", "dummy", "--seed", "3",
                             "--backend", "numpy", "--gpu-memory-gib", budget, "--quiet"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split()[3]
        lines = []
        while "context per slot" not in (line := proc.stdout.readline()):
            assert line, proc.stderr.read()
            lines.append(line)
        split = [ln for ln in lines if "mapped host memory; host experts per layer: 8,8,8,8" in ln]
        assert split, lines
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "deepseek-v4-flash", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "hello"}]})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_full_flash_bench_runs_on_a_shrunken_config(tmp_path: Path) -> None:
    """tools/bench_flash_full.py (the H200 figures' harness) runs end to end on NumPy."""
    model = write_config(tmp_path / "flash", shrunken_flash())
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_flash_full.py"),
                           "--backend", "numpy", "--config", str(model / "config.json"),
                           "--contexts", "16", "--ttft-tokens", "24", "--prefill-chunk", "16",
                           "--decode-tokens", "2", "--replace", "--json", str(out),
                           "--gpu-memory-gib", f"{half_budget_gib(shrunken_flash()):.9f}"],
                          capture_output=True, text=True, env=ENV, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "host experts per layer: 8,8,8,8" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["decode"][0]["finite"] and figures["decode"][0]["tok_s"] > 0
    assert figures["ttft"]["tokens"] == 24 and figures["floor"]["host_bytes_per_token"] > 0
    share = figures["counted"]["host_read_share"]  # the picks the steps counted
    assert 0 < share < 1 and "floor at the counted host share" in done.stdout
    counted = figures["floor_counted"]["host_bytes_per_token"]
    assert counted == pytest.approx(4 * 4 * share * expert_bytes(ModelConfig.from_dict(
        shrunken_flash())))  # k picks x 4 layers at that share


def test_the_whole_model_prefill_profile_runs_on_a_shrunken_config(tmp_path: Path) -> None:
    """tools/profile_prefill.py --whole (where a long prompt's prefill goes) runs end to end on
    NumPy over a model split between the memories, and its tables name the functions."""
    model = write_config(tmp_path / "flash", shrunken_flash())
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_prefill.py"),
                           "--backend", "numpy", "--config", str(model / "config.json"),
                           "--whole", "40", "--chunk", "16",
                           "--gpu-memory-gib", f"{half_budget_gib(shrunken_flash()):.9f}"],
                          capture_output=True, text=True, env=ENV, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "host experts read in place" in out and "whole model, 40 tokens" in out
    first, prompt = out.split("first 16 tokens, chunk 16: ")[1].split("prompt 40 tokens,")
    assert "Model._layer" in first and "select_entries" in prompt  # CSA layers' indexer
    assert int(first.split("Model._layer")[1].split()[0]) == 4  # one call a layer


def test_the_server_refuses_a_shipped_name_without_dummy_and_dummy_with_streaming() -> None:
    server = [sys.executable, "-m", "ds4.cli.server", "--port", "0", "--backend", "numpy",
              "--model", "deepseek-v4-flash"]
    done = subprocess.run(server, capture_output=True, text=True, env=ENV, check=False, timeout=60)
    assert done.returncode == 1 and "--load-format dummy" in done.stderr
    done = subprocess.run(server + ["--load-format", "dummy", "--ssd-streaming"],
                          capture_output=True, text=True, env=ENV, check=False, timeout=60)
    assert done.returncode == 2 and "--ssd-streaming" in done.stderr


def test_a_bf16_config_gets_bf16_words(tmp_path: Path) -> None:
    """No quantization_config: every matrix and expert as BF16 words, as such a checkpoint."""
    engine = Engine.open(write_config(tmp_path / "m", dict(TINY, vocab_size=512)),
                         backend="numpy", load_format="dummy")
    weights = engine.model.weights
    assert not weights.packed
    assert weights["model.layers.2.self_attn.q_a_proj.weight"].dtype == np.uint16
    assert weights.experts[0].stacked[0].dtype == np.uint16
    assert np.isfinite(logits_of(engine)).all()
