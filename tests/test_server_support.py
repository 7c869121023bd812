"""Shared pieces of the HTTP server tests: a live uvicorn server on the tiny model, the SSE
frames a client reads, and the slots a client can watch."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import uvicorn

from ds4.server.app import build_app
from ds4.server.config import ServerConfig
from ds4.server.connection import client_protocol

GREEDY = "deepseek-chat"  # alias: thinking off, so temperature 0 is honoured


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(load: bool = True, **overrides):
    """A uvicorn server on a free port in a thread, with ds4-server's connection protocol
    (slow clients get a 408); yields (base url, runtime). log_config=None lets every log
    record reach pytest's caplog (uvicorn's own config stops its loggers propagating)."""
    config = ServerConfig(**{"port": free_port(), **overrides})
    app = build_app(config, load=load)
    protocol = client_protocol(config.client_timeout_s, app.state.runtime.metrics)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.port,
                                           log_config=None, log_level="warning", http=protocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    deadline = time.monotonic() + 120
    while not server.started or (load and httpx.get(url + "/health").status_code != 200):
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.05)
    try:
        yield url, app.state.runtime
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def sse(text: str) -> list[tuple[str | None, object]]:
    """(event name, data) of each SSE frame; comments skipped, data parsed unless [DONE]."""
    out = []
    for frame in text.split("\n\n"):
        lines = [ln for ln in frame.splitlines() if ln and not ln.startswith(":")]
        if not lines:
            continue
        name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        data = next(ln[6:] for ln in lines if ln.startswith("data: "))
        out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


def busy_slots(url: str) -> list[int]:
    """Ids of the slots /slots reports busy."""
    return [s["id"] for s in httpx.get(url + "/slots").json()["slots"] if s["busy"]]


def wait_idle(url: str, seconds: float = 10) -> list[int]:
    """The busy slots left once all are idle or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    while busy_slots(url) and time.monotonic() < deadline:
        time.sleep(0.1)
    return busy_slots(url)
