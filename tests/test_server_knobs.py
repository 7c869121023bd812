"""Knobs a user sets, over real HTTP on the tiny model: stop strings (in either order, and a
stream whose tail only looks like one), top_p outside (0, 1], and the server's `--tokens`
default on every route. Greedy, thinking off (deepseek-chat) unless a test samples."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from test_server_support import GREEDY, free_port, live_server, sse

DEFAULT_TOKENS = 5
CHAT, COMPLETIONS, RESPONSES, MESSAGES = ("/v1/chat/completions", "/v1/completions",
                                          "/v1/responses", "/v1/messages")
STORY = [{"role": "user", "content": "Tell me a story"}]
NEVER = "\u2603\u2603 never written"  # no tokenizer piece of the tiny model's output holds this


@pytest.fixture(scope="module")
def url():
    with live_server(parallel=1, ctx=2048, tokens=DEFAULT_TOKENS) as (base, _runtime):
        yield base


def post(url: str, route: str, body: dict) -> dict:
    r = httpx.post(url + route, json={"model": GREEDY, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, route: str, body: dict) -> list:
    """The parsed SSE frames of a streamed request."""
    body = {"model": GREEDY, "temperature": 0, "stream": True, **body}
    r = httpx.post(url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return sse(r.text)


def chat_text(url: str, **body) -> tuple[str, str]:
    """(content, finish_reason) of a non-streamed chat completion of STORY."""
    choice = post(url, CHAT, {"messages": STORY, **body})["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def chat_stream(url: str, **body) -> tuple[str, str]:
    """(content the deltas add up to, finish_reason) of a streamed chat completion of STORY."""
    frames = [d for _, d in stream(url, CHAT, {"messages": STORY, **body}) if d != "[DONE]"]
    text = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f["choices"])
    finish = [f["choices"][0]["finish_reason"] for f in frames if f["choices"]]
    return text, finish[-1]


def completion(url: str, streamed: bool, **body) -> tuple[str, str]:
    """(text, finish_reason) of a completion of "Once upon a time"."""
    body = {"prompt": "Once upon a time", **body}
    if not streamed:
        choice = post(url, COMPLETIONS, body)["choices"][0]
        return choice["text"], choice["finish_reason"]
    frames = [d for _, d in stream(url, COMPLETIONS, body) if d != "[DONE]"]
    text = "".join(f["choices"][0]["text"] for f in frames if f["choices"])
    return text, [f["choices"][0]["finish_reason"] for f in frames if f["choices"]][-1]


def two_stops(text: str) -> tuple[str, str, int]:
    """(late, early, cut): substrings of text, where the earlier one starts at `cut`."""
    early, late = text[8:12], text[24:29]
    cut = min(text.find(early), text.find(late))
    assert 0 < cut <= 8 and len(text) > 40
    return late, early, cut


@pytest.mark.parametrize("order", [1, -1], ids=["late-first", "early-first"])
def test_chat_stops_at_the_earliest_stop_string_in_either_order(url, order):
    full, finish = chat_text(url, max_tokens=40)
    assert finish == "length"
    late, early, cut = two_stops(full)
    stops = [late, early][::order]
    assert chat_text(url, max_tokens=40, stop=stops) == (full[:cut], "stop")
    assert chat_stream(url, max_tokens=40, stop=stops) == (full[:cut], "stop")


@pytest.mark.parametrize("order", [1, -1], ids=["late-first", "early-first"])
def test_completions_stop_at_the_earliest_stop_string_in_either_order(url, order):
    full, _ = completion(url, False, max_tokens=40)
    late, early, cut = two_stops(full)
    stops = [late, early][::order]
    assert completion(url, False, max_tokens=40, stop=stops) == (full[:cut], "stop")
    assert completion(url, True, max_tokens=40, stop=stops) == (full[:cut], "stop")


@pytest.mark.parametrize("order", [1, -1], ids=["late-first", "early-first"])
def test_messages_report_the_earliest_stop_sequence_in_either_order(url, order):
    body = {"messages": STORY, "max_tokens": 40}
    full = post(url, MESSAGES, body)["content"][0]["text"]
    late, early, cut = two_stops(full)
    done = post(url, MESSAGES, {**body, "stop_sequences": [late, early][::order]})
    assert done["content"][0]["text"] == full[:cut]
    want = early if full.find(early) == cut else late
    assert (done["stop_reason"], done["stop_sequence"]) == ("stop_sequence", want)


def test_a_stream_whose_tail_looks_like_a_stop_string_gets_all_of_its_text(url):
    full, _ = chat_text(url, max_tokens=40)
    stop = full[-3:] + NEVER  # the answer's last characters begin this stop string
    assert chat_stream(url, max_tokens=40, stop=[stop]) == (full, "length")
    assert chat_text(url, max_tokens=40, stop=[stop]) == (full, "length")
    text, _ = completion(url, False, max_tokens=40)
    stop = text[-3:] + NEVER
    assert completion(url, True, max_tokens=40, stop=[stop]) == (text, "length")


@pytest.mark.parametrize("top_p", [0, -1, 1.5])
def test_top_p_outside_zero_to_one_samples_as_top_p_one(url, top_p):
    sampled = {"temperature": 1.0, "seed": 7, "min_p": 0.0, "max_tokens": 12}
    want = chat_text(url, **sampled, top_p=1.0)
    assert want != chat_text(url, max_tokens=12)  # really sampled: not the greedy text
    assert chat_text(url, **sampled, top_p=top_p) == want
    texts = [post(url, COMPLETIONS, {"prompt": "Once", **sampled, "top_p": p})["choices"][0]
             ["text"] for p in (1.0, top_p)]
    assert texts[0] == texts[1]


def default_limited(url: str, route: str, body: dict) -> tuple[int, str]:
    """(output tokens, why it ended) of a request that sets no max-tokens field."""
    done = post(url, route, body)
    if route == MESSAGES:
        return done["usage"]["output_tokens"], done["stop_reason"]
    if route == RESPONSES:
        return done["usage"]["output_tokens"], done["incomplete_details"]["reason"]
    return done["usage"]["completion_tokens"], done["choices"][0]["finish_reason"]


@pytest.mark.parametrize("route, body, ended", [
    (CHAT, {"messages": STORY}, "length"),
    (COMPLETIONS, {"prompt": "Once upon a time"}, "length"),
    (RESPONSES, {"input": "Tell me a story"}, "max_output_tokens"),
    (MESSAGES, {"messages": STORY}, "max_tokens"),  # ds4 takes the default where Anthropic 400s
])
def test_the_server_default_limits_a_request_that_sets_none(url, route, body, ended):
    assert default_limited(url, route, body) == (DEFAULT_TOKENS, ended)


def test_a_request_limit_overrides_the_default_either_way(url):
    assert default_limited(url, CHAT, {"messages": STORY, "max_tokens": 3}) == (3, "length")
    assert default_limited(url, CHAT, {"messages": STORY, "max_tokens": 9}) == (9, "length")
    frames = stream(url, CHAT, {"messages": STORY, "stream_options": {"include_usage": True}})
    usage = [d["usage"] for _, d in frames if d != "[DONE]" and d.get("usage")]
    assert usage[-1]["completion_tokens"] == DEFAULT_TOKENS


def test_ds4_server_tokens_flag_sets_the_default_limit():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ds4.cli.server", "--port", str(port),
                             "--ctx", "1024", "--tokens", "3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        card = httpx.get(base + "/v1/models/deepseek-v4-flash").json()
        assert card["top_provider"]["max_completion_tokens"] == 3
        assert default_limited(base, CHAT, {"messages": STORY}) == (3, "length")
        assert default_limited(base, MESSAGES, {"messages": STORY}) == (3, "max_tokens")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_healthy(base: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    """Poll /health until the server answers 200 (it fails the test if the process dies)."""
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None and time.monotonic() < deadline
        try:
            if httpx.get(base + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
