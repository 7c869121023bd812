"""A short run of tools/soak.py against a real ds4-server process (tiny model, loopback,
--parallel 2): good, malformed, cut-short, oversized and slow clients, then idle slots, an
empty queue, bounded RSS, and the access log on stderr (none with --quiet)."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import httpx
from test_server_support import free_port

TOOL = Path(__file__).resolve().parents[1] / "tools" / "soak.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("soak", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def ds4_server(tmp_path: Path, *flags: str):
    """`ds4-server` on a free loopback port; yields (url, path of its stderr)."""
    port = free_port()
    err = tmp_path / f"stderr-{port}.txt"
    with open(err, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "ds4.cli.server", "--port", str(port),
                                 "--ctx", "1024", "--parallel", "2", *flags],
                                stdout=subprocess.DEVNULL, stderr=sink)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        yield url, err
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.TransportError:
        return False


def test_short_soak_leaves_the_server_whole(tmp_path, capsys):
    soak = load_tool()
    with ds4_server(tmp_path, "--client-timeout", "1") as (url, err):
        rc = soak.main(["--url", url, "--clients", "4", "--requests", "5", "--max-tokens", "4",
                        "--bad-share", "0.4", "--cut-share", "0.2", "--large-share", "0.1",
                        "--large-bytes", "300000", "--slow-clients", "2", "--slow-gap", "0.3",
                        "--client-timeout", "1", "--settle", "20", "--seed", "3"])
        out = capsys.readouterr().out
        assert rc == 0, out
        log = err.read_text()
    assert "soak: 20 requests" in out and "soak: PASS" in out
    assert "rss: before" in out and "slow clients: 2, held at most" in out
    assert "Traceback" not in log
    lines = [ln for ln in log.splitlines() if ln.startswith("ds4-server: 127.0.0.1:")]
    posts = [ln for ln in lines if " POST /v1/" in ln]
    assert len(posts) >= 20 - 2  # warm-up and soak requests; a bad GET path is not a POST
    assert any(" 408 " in ln for ln in lines)  # the slow clients
    assert any("prompt_tokens=" in ln and "completion_tokens=" in ln for ln in posts)


def test_quiet_server_writes_no_access_log(tmp_path):
    with ds4_server(tmp_path, "--quiet") as (url, err):
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": "deepseek-chat", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
    assert "POST /v1/chat/completions" not in err.read_text()
