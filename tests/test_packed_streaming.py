"""`ds4-server --ssd-streaming`: routed experts are read from the mapped checkpoint per use,
not held; the printed memory report shows fewer resident weight bytes and the tokens are the
same (built-in tiny model, bf16, and its official-format FP8 + FP4 copy)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server_support import free_port

ROOT = Path(__file__).resolve().parents[1]


def _serve_once(extra: list[str]) -> tuple[int, dict]:
    """Start ds4-server, read its printed weight_bytes, run one greedy completion, stop it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ds4.cli.server", "--port", str(port),
                             "--ctx", "512", "--backend", "numpy", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text = ""
        for line in proc.stdout:
            text += line
            if "context per slot" in line or "failed to load" in line:
                break
        weight = re.search(r"weight_bytes: (\d+)", text)
        assert weight, text
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{port}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "deepseek-chat", "prompt": "The packed experts of layer",
                             "max_tokens": 12, "temperature": 0, "logprobs": 1})
        assert r.status_code == 200, r.text
        return int(weight.group(1)), r.json()["choices"][0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def packed_tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("official") / "tiny"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_official.py"), "tiny", str(out)],
                   check=True, cwd=ROOT, capture_output=True)
    return str(out)


@pytest.mark.parametrize("packed", [False, True])
def test_ssd_streaming_same_tokens_fewer_resident_bytes(packed, packed_tiny):
    model = ["--model", packed_tiny] if packed else []
    held_bytes, held = _serve_once(model)
    streamed_bytes, streamed = _serve_once(model + ["--ssd-streaming"])
    assert streamed["text"] == held["text"] and streamed["logprobs"] == held["logprobs"]
    assert streamed["finish_reason"] == held["finish_reason"] == "length"
    # the tiny model's routed experts: 6 layers x 8 experts x (gate, up, down) of 64 x 32
    expert_values = 6 * 8 * 3 * 64 * 32
    per_value = 0.5 + 1 / 32 if packed else 2  # FP4 codes + a scale per 32, or bf16 words
    assert held_bytes - streamed_bytes == pytest.approx(expert_values * per_value)
