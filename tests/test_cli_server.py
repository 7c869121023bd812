"""`ds4-server` as a process: flags, binding, a model that cannot load, and a clean stop on
SIGTERM / SIGINT while streams run."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ds4.backend import cuda_available
from ds4.engine import default_model_dir
from ds4.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
SERVER = [sys.executable, "-m", "ds4.cli.server"]
LONG = 100_000  # max_tokens no stream reaches before the signal


def run(*argv: str, timeout: float = 20) -> subprocess.CompletedProcess:
    """A command run to its end."""
    return subprocess.run(list(argv), capture_output=True, text=True, env=ENV, timeout=timeout)


def read_line(proc: subprocess.Popen, seconds: float) -> str:
    """One line of the process's stdout, waiting at most `seconds`."""
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    assert ready, "no output in time"
    return proc.stdout.readline()


def start_server(*flags: str) -> tuple[subprocess.Popen, str]:
    """A `ds4-server --port 0` on the tiny model, serving; (process, base URL)."""
    proc = subprocess.Popen([*SERVER, "--port", "0", "--ctx", "2048", *flags], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = read_line(proc, 20)
    assert "listening on http://127.0.0.1:" in line, line
    url = line.split()[3]
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health").status_code != 200:
        assert time.monotonic() < deadline and proc.poll() is None, "model did not load"
        time.sleep(0.05)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """Make sure a test's server is gone."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


# -- flags ------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_port_outside_0_65535_is_an_argparse_error(port: str) -> None:
    result = run(*SERVER, "--port", port)
    assert result.returncode == 2
    assert "argument --port" in result.stderr and "Traceback" not in result.stderr


def test_port_in_use_is_one_line_and_exit_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(*SERVER, "--port", str(port))
    assert result.returncode == 1
    assert result.stderr == f"ds4-server: cannot listen on 127.0.0.1:{port}: " \
                            "address already in use\n"
    assert "listening" not in result.stdout


def test_listening_is_printed_once_bound_with_the_real_port() -> None:
    proc, url = start_server()
    try:
        port = int(url.rsplit(":", 1)[1])
        assert port > 0
        with socket.socket() as probe:  # the port is held: binding it again fails
            with pytest.raises(OSError):
                probe.bind(("127.0.0.1", port))
    finally:
        stop(proc)


# -- a model that cannot load -------------------------------------------------------------


def tiny_copy(tmp_path: Path) -> Path:
    """The tiny model's files in a directory a test may spoil (weights linked, not copied)."""
    src, dst = default_model_dir(), tmp_path / "model"
    dst.mkdir()
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def spoiled(tmp_path: Path, how: str) -> Path:
    """A model directory broken in one way."""
    model = tiny_copy(tmp_path)
    if how == "missing":
        return tmp_path / "absent"
    if how == "file":
        return model / "config.json"
    if how == "unreadable":
        model.chmod(0)
    if how == "no config":
        (model / "config.json").unlink()
    if how == "bad json":
        (model / "config.json").write_text("{not json")
    if how == "bad field":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "hidden_size": "wide"}))
    if how == "big tokenizer":
        data = json.loads(Tokenizer.for_model(None).path.read_text())
        data["added_tokens"].append({**data["added_tokens"][-1], "id": 129280,
                                     "content": "<｜extra｜>"})
        (model / "tokenizer.json").write_text(json.dumps(data))
    return model


@pytest.mark.parametrize("how, words", [
    ("missing", "no such directory"),
    ("file", "not a directory"),
    pytest.param("unreadable", "directory is not readable", marks=pytest.mark.skipif(
        os.geteuid() == 0, reason="root reads every directory")),
    ("no config", "no config.json"),
    ("bad json", "config.json cannot be read as JSON"),
    ("bad field", "'hidden_size'"),
    ("big tokenizer", "has 129281 tokens but the model's vocab_size is 129280"),
])
def test_a_model_that_cannot_load_ends_the_server(tmp_path: Path, how: str, words: str) -> None:
    model = spoiled(tmp_path, how)
    start = time.monotonic()
    result = run(*SERVER, "--port", "0", "--model", str(model), timeout=20)
    assert time.monotonic() - start < 15
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"ds4-server: model failed to load: {model}: ")
    assert words in lines[0]


def test_ds4_generate_refuses_a_tokenizer_too_big_for_the_model(tmp_path: Path) -> None:
    model = spoiled(tmp_path, "big tokenizer")
    result = run(sys.executable, "-m", "ds4", "generate", "--backend", "numpy", "-p", "Hi",
                 "--model", str(model))
    assert result.returncode == 1
    assert result.stderr.startswith("ds4: tokenizer ") and "vocab_size is 129280" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU")
def test_cupy_backend_without_a_gpu_ends_the_server() -> None:
    result = run(*SERVER, "--port", "0", "--backend", "cupy")
    assert result.returncode == 1
    assert result.stderr.strip().endswith(
        "backend 'cupy' needs CuPy and a CUDA device of compute capability 8.0 or newer (A100, "
        "RTX 30xx, H100); none found")


# -- stopping -------------------------------------------------------------------------------

CHAT = ("/v1/chat/completions", {"model": "deepseek-chat", "stream": True, "max_tokens": LONG,
                                 "messages": [{"role": "user", "content": "Tell me a story."}]})
MESSAGES = ("/v1/messages", {"model": "deepseek-chat", "stream": True, "max_tokens": LONG,
                             "messages": [{"role": "user", "content": "Tell me a story."}]})


def stream_until_signal(url: str, route: tuple[str, dict], proc: subprocess.Popen,
                        sig: int) -> tuple[list[str], float]:
    """Open a stream, signal the server once tokens flow; the stream's lines and the time
    from the signal to the stream's end."""
    path, body = route
    lines: list[str] = []
    with httpx.stream("POST", url + path, json=body, timeout=10) as response:
        assert response.status_code == 200
        it = response.iter_lines()
        while sum('"text_delta"' in ln or '"content"' in ln for ln in lines) < 3:
            lines.append(next(it))
        proc.send_signal(sig)
        signalled = time.monotonic()
        lines.extend(it)
    return lines, time.monotonic() - signalled


def data_of(lines: list[str]) -> list[object]:
    """The data of each SSE `data:` line (parsed JSON, or the string [DONE])."""
    return [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:])
            for ln in lines if ln.startswith("data: ")]


def stop_during_stream(route: tuple[str, dict], sig: int) -> tuple[list[str], float, float,
                                                                   int, str]:
    """A server stopped by `sig` mid-stream: the stream's lines, seconds from the signal to
    the stream's end and to the process's exit, its exit status and its stderr."""
    proc, url = start_server()
    try:
        lines, took = stream_until_signal(url, route, proc, sig)
        start = time.monotonic() - took
        code = proc.wait(timeout=5)
        exited = time.monotonic() - start
    finally:
        stop(proc)
    return lines, took, exited, code, proc.stderr.read()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_openai_streams_with_an_error_then_done(sig: int) -> None:
    lines, took, exited, code, stderr = stop_during_stream(CHAT, sig)
    assert took < 1.0 and exited < 2.0
    data = data_of(lines)
    assert data[-1] == "[DONE]"
    assert "shut" in data[-2]["error"]["message"], lines[-6:]
    assert all(c["finish_reason"] != "error" for d in data[:-2] for c in d["choices"])
    assert code == 0
    assert "Traceback" not in stderr


def test_a_stop_signal_ends_anthropic_streams_with_an_error_event() -> None:
    lines, took, exited, code, stderr = stop_during_stream(MESSAGES, signal.SIGTERM)
    assert took < 1.0 and exited < 2.0
    events = [ln[7:] for ln in lines if ln.startswith("event: ")]
    assert events[-1] == "error"
    error = data_of(lines)[-1]
    assert error["type"] == "error" and "shut" in error["error"]["message"]
    assert code == 0
    assert "Traceback" not in stderr


# -- --ssd-streaming ------------------------------------------------------------------------


def test_ssd_streaming_holds_fewer_weight_bytes_and_answers_the_same() -> None:
    from test_server_support import GREEDY, live_server

    body = {"model": GREEDY, "prompt": "The sea", "max_tokens": 8, "temperature": 0}
    seen = {}
    for streaming in (False, True):
        with live_server(ctx=512, backend="numpy", ssd_streaming=streaming) as (url, runtime):
            reply = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
            seen[streaming] = (reply["choices"][0]["text"],
                               runtime.engine.memory_report()["weight_bytes"])
    assert seen[True][0] == seen[False][0]
    assert seen[True][1] < seen[False][1]  # the routed experts stay in the mapped file
