"""The `ds4` command: make-tiny, generate (streams text, reports speeds), statechart."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ds4.cli.main import main, plain_chat
from ds4.tokenizer import BOS_ID, Tokenizer

SPEED_LINE = r"{}: {} tokens in [0-9.]+ s, [0-9.]+ tokens/s"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["make-tiny", str(directory)]) == 0
    return directory


def test_make_tiny_writes_a_model_directory(tiny: Path, capsys) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert config["vocab_size"] == 129280 and config["model_type"] == "deepseek_v4"
    assert (tiny / "model.safetensors").stat().st_size > 1_000_000
    assert Tokenizer.for_model(tiny).path == tiny / "tokenizer.json"


def test_plain_chat_prompt_tokens() -> None:
    tok = Tokenizer.for_model(None)
    ids = tok.encode(plain_chat("Hello"))
    assert ids[0] == BOS_ID
    assert tok.decode(ids) == "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜></think>"
    assert tok.encode("<｜User｜>")[0] in ids and tok.encode("<｜Assistant｜>")[0] in ids


def generate(capsys, *extra: str) -> tuple[str, str]:
    """Run `ds4 generate` in-process; returns (stdout, stderr)."""
    assert main(["generate", "--backend", "numpy", *extra]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_generate_streams_text_and_prints_speeds(tiny: Path, capsys) -> None:
    out, err = generate(capsys, "-p", "Say something.", "-n", "8", "--model", str(tiny))
    assert out.strip()
    prompt_len = len(Tokenizer.for_model(tiny).encode(plain_chat("Say something.")))
    assert re.search(SPEED_LINE.format("prefill", prompt_len), err), err
    assert re.search(SPEED_LINE.format("decode", 8), err), err
    again, _ = generate(capsys, "-p", "Say something.", "-n", "8", "--model", str(tiny))
    assert again == out  # greedy is deterministic


def test_seeded_sampling_repeats_and_differs_from_greedy(tiny: Path, capsys) -> None:
    args = ["-p", "Tell a story.", "-n", "12", "--model", str(tiny), "--temperature", "1.0",
            "--seed", "3"]
    first, _ = generate(capsys, *args)
    second, _ = generate(capsys, *args)
    greedy, _ = generate(capsys, "-p", "Tell a story.", "-n", "12", "--model", str(tiny))
    assert first == second
    assert first != greedy


def test_generate_without_model_uses_the_cached_tiny_model(tmp_path: Path, monkeypatch,
                                                           capsys) -> None:
    monkeypatch.setenv("DS4_CACHE_DIR", str(tmp_path))
    out, err = generate(capsys, "-p", "Hi", "-n", "2")
    assert out.strip() and "decode: 2 tokens" in err
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-1"]


def test_prompt_longer_than_the_context_fails_clearly(tiny: Path, capsys) -> None:
    code = main(["generate", "--backend", "numpy", "-p", "word " * 50, "--ctx", "16", "--model",
                 str(tiny)])
    assert code == 1
    assert "ds4:" in capsys.readouterr().err


@pytest.mark.parametrize("fmt, marker", [("mermaid", "stateDiagram"), ("dot", "digraph")])
def test_statechart_export(tmp_path: Path, fmt: str, marker: str, capsys) -> None:
    path = tmp_path / f"job.{fmt}"
    assert main(["statechart", "--format", fmt, "-o", str(path)]) == 0
    assert marker in path.read_text()


def test_missing_model_directory_fails_clearly(tmp_path: Path, capsys) -> None:
    code = main(["generate", "--backend", "numpy", "-p", "Hi", "--model", str(tmp_path / "absent")])
    assert code == 1
    assert "ds4:" in capsys.readouterr().err
