"""Bad input and hostile clients over real HTTP (uvicorn on 127.0.0.1 with ds4's connection
protocol, tiny model): lone surrogates, a bug's 500 on a keep-alive connection, slow and
vanishing clients, and what /metrics and the access log say about each request."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from test_server_support import GREEDY, live_server, sse

from ds4.cli.server import config_from
from ds4.server import models

TIMEOUT_S = 1.0  # the client timeout of the server under test
CTX = 4096
HI = [{"role": "user", "content": "Say hi"}]
LONE = "hi \ud800"  # json.dumps writes it as the escape "\ud800"


def hostile_server(load: bool = True, **overrides):
    """A live server as ds4-server builds it, with a short client timeout."""
    return live_server(load, **{"client_timeout_s": TIMEOUT_S, "parallel": 2, "ctx": CTX,
                                **overrides})


@pytest.fixture(scope="module")
def live():
    with hostile_server() as (url, runtime):
        yield url, runtime


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    """POST with the body as ASCII JSON: lone surrogates travel as their escapes."""
    return httpx.post(url + path, content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"}, **kw)


def error_of(path: str, got: dict) -> dict:
    """The inner error object, checking the protocol's outer shape."""
    if path.startswith("/v1/messages"):
        assert got["type"] == "error" and set(got["error"]) >= {"type", "message"}
    else:
        assert set(got["error"]) >= {"message", "type", "param", "code"}
    return got["error"]


def call_history(arguments: str) -> list[dict]:
    """A chat history whose assistant tool call carries `arguments` (a JSON string)."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get", "arguments": arguments}}
    return [*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]


TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
CHAT, COMPL, RESP, MSG, COUNT = ("/v1/chat/completions", "/v1/completions", "/v1/responses",
                                 "/v1/messages", "/v1/messages/count_tokens")
SURROGATE_BODIES = [
    (CHAT, {"messages": [{"role": "user", "content": LONE}]}),
    (CHAT, {"model": LONE, "messages": HI}),
    (CHAT, {"messages": HI, "stop": [LONE]}),
    (CHAT, {"messages": HI, "tools": [{**TOOL, "function": {"name": LONE}}]}),
    (CHAT, {"messages": call_history(json.dumps({"q": LONE}))}),   # escape inside arguments
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}),
    (CHAT, {"messages": HI, "metadata": {LONE: 1}}),                # even in a key
    (COMPL, {"prompt": LONE}),
    (COMPL, {"prompt": [LONE]}),
    (RESP, {"input": LONE}),
    (RESP, {"input": "x", "instructions": LONE}),
    (MSG, {"max_tokens": 4, "messages": [{"role": "user", "content": LONE}]}),
    (MSG, {"max_tokens": 4, "messages": HI, "system": LONE}),
    (MSG, {"max_tokens": 4, "model": LONE, "messages": HI}),
    (COUNT, {"messages": [{"role": "user", "content": "x\udfff"}]}),
    (COUNT, {"messages": HI, "system": [{"type": "text", "text": LONE}]}),
]


@pytest.mark.parametrize("path, body", SURROGATE_BODIES,
                         ids=[f"{p}-{i}" for i, (p, _) in enumerate(SURROGATE_BODIES)])
def test_a_lone_surrogate_anywhere_is_a_400_in_the_protocols_shape(live, path, body):
    r = post(live[0], path, body)
    assert r.status_code == 400, r.text
    assert "lone surrogate" in error_of(path, r.json())["message"]


def test_paired_surrogate_escapes_are_text(live):
    body = {"model": GREEDY, "max_tokens": 2,
            "messages": [{"role": "user", "content": "\U0001F600"}]}
    assert post(live[0], CHAT, body).status_code == 200


def test_a_500_closes_its_keep_alive_connection_cleanly(live, monkeypatch):
    url, runtime = live

    def boom(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(models, "model_card", boom)
    monkeypatch.setattr(runtime, "tokenize", boom)
    with httpx.Client(base_url=url) as client:
        for method, path, shape in (("GET", "/v1/models", "openai"),
                                    ("POST", COUNT, "anthropic")):
            r = client.request(method, path, json={"messages": HI})
            assert r.status_code == 500 and r.headers["connection"] == "close"
            assert "RuntimeError: a bug" in error_of(path, r.json())["message"]
            assert (r.json().get("type") == "error") == (shape == "anthropic")
            assert client.get("/health").status_code == 200  # the next request is served
        monkeypatch.undo()
        ok = client.post(CHAT, json={"model": GREEDY, "messages": HI, "max_tokens": 2})
        assert ok.status_code == 200 and "connection" not in ok.headers  # kept alive


def test_a_500_carries_the_cors_headers(monkeypatch):
    monkeypatch.setattr(models, "model_card", lambda *a: 1 / 0)
    with hostile_server(load=False, cors=True) as (url, _):
        r = httpx.get(url + "/v1/models")
    assert r.status_code == 500 and r.headers["access-control-allow-origin"] == "*"
    assert "ZeroDivisionError" in r.json()["error"]["message"]


def connect(url: str) -> socket.socket:
    """A raw TCP connection to the server."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_all(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (seconds)."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def trickle(sock: socket.socket, head: bytes, stop: threading.Event) -> None:
    """Send `head`, then one byte every 0.3 s until the server gives up (or `stop`)."""
    sock.sendall(head)
    with contextlib.suppress(OSError):
        while not stop.wait(0.3):
            sock.sendall(b"x")


def slow_clients(url: str, heads: list[bytes]) -> list[tuple[bytes, float]]:
    """Trickle each head on its own connection; what each got and when it was closed."""
    stop = threading.Event()
    socks = [connect(url) for _ in heads]
    threads = [threading.Thread(target=trickle, args=(s, h, stop), daemon=True)
               for s, h in zip(socks, heads)]
    for t in threads:
        t.start()
    try:
        return [read_all(s, 10 * TIMEOUT_S) for s in socks]
    finally:
        stop.set()
        for s in socks:
            s.close()


def body_head(path: str, length: int) -> bytes:
    """Request headers announcing a JSON body of `length` bytes."""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


def http_body(raw: bytes) -> tuple[int, dict]:
    """(status, JSON body) of one raw HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_slow_headers_and_bodies_get_a_408_and_are_released(live, caplog):
    url = live[0]
    caplog.set_level(logging.INFO, logger="ds4.access")
    heads = [b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "] * 6 + \
            [body_head(CHAT, 500)] * 3 + [body_head(MSG, 500) + b'{"messages": ']
    got = slow_clients(url, heads)
    for raw, closed_after in got:
        assert closed_after < 3 * TIMEOUT_S + 1  # released, although bytes kept coming
        status, body = http_body(raw)
        assert status == 408 and "request timeout" in (body["error"]["message"])
    assert http_body(got[-1][0])[1]["type"] == "error"  # /v1/messages: Anthropic's shape
    deadline = time.monotonic() + 3  # the app logs its 408s once it saw the connection go
    while len(lines := access_lines(caplog)) < len(heads) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum("(request headers incomplete)" in ln for ln in lines) == 6
    assert metric(url, 'ds4_http_requests_total{route="other",status="4xx"}') >= 6
    assert sum("POST /v1/chat/completions 408" in ln for ln in lines) == 3
    assert sum("POST /v1/messages 408" in ln and "too slowly" in ln for ln in lines) == 1
    r = httpx.post(url + CHAT, json={"model": GREEDY, "messages": HI, "max_tokens": 2})
    assert r.status_code == 200


def test_client_timeout_and_quiet_flags():
    config = config_from(["--client-timeout", "2.5", "--quiet"])
    assert config.client_timeout_s == 2.5 and config.quiet
    assert config_from([]).client_timeout_s == 10.0 and not config_from([]).quiet
    with pytest.raises(SystemExit) as exit_:
        config_from(["--client-timeout", "0"])
    assert exit_.value.code == 2


def test_a_silent_connection_is_closed_and_a_steady_one_served(live):
    url = live[0]
    with connect(url) as sock:
        raw, closed_after = read_all(sock, 10 * TIMEOUT_S)
    assert raw == b"" and closed_after < 3 * TIMEOUT_S
    # 64 KiB in four pieces 0.4 timeouts apart: longer than the timeout in all, but at a
    # rate that earns the body more time, and never stalled for a whole timeout
    body = json.dumps({"model": GREEDY, "messages": HI, "max_tokens": 2}).encode()
    body += b" " * (65536 - len(body))
    with connect(url) as sock:
        sock.sendall(body_head(CHAT, len(body)))
        for i in range(0, len(body), 16384):
            time.sleep(0.4 * TIMEOUT_S)
            sock.sendall(body[i:i + 16384])
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ds4.access"]


def test_a_client_gone_while_its_body_is_read_is_one_log_line(live, caplog):
    url = live[0]
    caplog.set_level(logging.INFO)
    with connect(url) as sock:
        me = f"127.0.0.1:{sock.getsockname()[1]:d} "
        sock.sendall(body_head(CHAT, 1000) + b'{"messages": [')
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while not any(me in line for line in access_lines(caplog)):
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
    time.sleep(0.3)  # anything else it would log comes now
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    server = [r for r in caplog.records if r.name.startswith(("ds4", "uvicorn"))]
    lines = [r.getMessage() for r in server if r.name != "ds4.access" or me in r.getMessage()]
    assert len(lines) == 1 and me + "POST /v1/chat/completions 499" in lines[0], lines
    assert "closed the connection" in lines[0]


def metric(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def test_metrics_count_every_request_by_route_and_status_class(live):
    url = live[0]
    ok = 'ds4_http_requests_total{route="/v1/chat/completions",status="2xx"}'
    bad = 'ds4_http_requests_total{route="/v1/chat/completions",status="4xx"}'
    other = 'ds4_http_requests_total{route="other",status="4xx"}'
    seconds = 'ds4_http_request_seconds_count{route="/v1/chat/completions"}'
    before = {m: metric(url, m) for m in (ok, bad, other, seconds)}
    assert httpx.post(url + CHAT, json={"model": GREEDY, "messages": HI,
                                        "max_tokens": 2}).status_code == 200
    assert httpx.post(url + CHAT, json={"messages": "no"}).status_code == 400
    for path in ("/nope", "/wp-admin/x.php", "/v1/nope"):
        assert httpx.get(url + path).status_code == 404
    after = {m: metric(url, m) for m in before}
    assert after[ok] - before[ok] == 1 and after[bad] - before[bad] == 1
    assert after[other] - before[other] == 3 and after[seconds] - before[seconds] == 2
    text = httpx.get(url + "/metrics").text
    assert "/nope" not in text and 'ds4_http_request_seconds_bucket{le="0.01",route=' in text


def test_access_line_of_a_stream_is_written_when_it_ends(live, caplog):
    url, runtime = live
    caplog.set_level(logging.INFO, logger="ds4.access")
    body = {"model": GREEDY, "messages": HI, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + CHAT, json=body) as r:
        frames = iter(r.iter_text())
        first = next(frames)
        assert not [ln for ln in access_lines(caplog) if CHAT in ln]  # still streaming
        text = first + "".join(frames)
    usage = [d for _, d in sse(text) if isinstance(d, dict) and d.get("usage")][-1]["usage"]
    deadline = time.monotonic() + 5
    while not (lines := [ln for ln in access_lines(caplog) if CHAT in ln]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    words = lines[0].split()
    assert words[1:4] == ["POST", CHAT, "200"] and words[4].endswith("s")
    assert f"prompt_tokens={usage['prompt_tokens']}" in words
    assert f"completion_tokens={usage['completion_tokens']}" in words


def refused_prompt(url: str, text: str) -> dict:
    """The error of a chat request whose prompt cannot fit the context."""
    r = post(url, CHAT, {"model": GREEDY, "max_tokens": 2,
                         "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400, r.text
    error = error_of(CHAT, r.json())
    assert error["code"] == "context_length_exceeded" and error["n_ctx"] == CTX
    assert "Prompt has more than" in error["message"] and error["n_prompt_tokens"] > CTX
    return error


def test_a_prompt_far_past_the_context_is_refused_without_tokenizing_it_whole(live):
    url, runtime = live
    text = " ".join(f"w{i}" for i in range(60_000))  # ~350k characters, ~100k tokens
    n_tokens = len(runtime.engine.tokenizer.encode(text))
    assert refused_prompt(url, text)["n_prompt_tokens"] < n_tokens  # from a prefix's tokens
    r = post(url, COUNT, {"messages": [{"role": "user", "content": text}]})
    assert r.json()["input_tokens"] > n_tokens  # counted whole, with the template
    longer = text * 4  # past 128 characters a context token: refused from its length
    assert 0 <= refused_prompt(url, longer)["n_prompt_tokens"] - len(longer) // 128 < 4
