"""How turns end, over real HTTP on the tiny model: stop sequences reported as each protocol
does, and forced tool calls the random model cannot complete (encoding.md §4.5, §5.5)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from test_server_http import live_server

GREEDY = "deepseek-chat"  # thinking off, so temperature 0 is honoured
HI = [{"role": "user", "content": "Say hi"}]
MSG, CHAT = "/v1/messages", "/v1/chat/completions"


@pytest.fixture(scope="module")
def live():
    with live_server(ctx=2048, ping_interval_s=1.0) as (url, runtime):
        yield url, runtime


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


def claude_body(**extra) -> dict:
    return {"model": GREEDY, "max_tokens": 16, "temperature": 0, "messages": HI, **extra}


@pytest.fixture(scope="module")
def stop_case(live):
    """A stop string taken from the middle of the isolated greedy answer, and the text before
    its first occurrence (what a stopped answer must be)."""
    free = httpx.post(live[0] + MSG, json=claude_body(), timeout=60).json()
    text = free["content"][0]["text"]
    assert free["stop_reason"] == "max_tokens" and len(text) >= 6, free
    stop = text[len(text) // 2: len(text) // 2 + 3]
    return stop, text[: text.find(stop)]


def test_anthropic_reports_the_stop_sequence_that_ended_the_message(live, stop_case):
    stop, before = stop_case
    url = live[0]
    body = httpx.post(url + MSG, json=claude_body(stop_sequences=["never!", stop]),
                      timeout=60).json()
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == stop
    assert body["content"] == [{"type": "text", "text": before}]
    assert body["usage"]["output_tokens"] < 16

    r = httpx.post(url + MSG, json=claude_body(stop_sequences=[stop], stream=True), timeout=60)
    frames = sse(r.text)
    [start] = [d for n, d in frames if n == "message_start"]
    assert start["message"]["stop_reason"] is None and start["message"]["stop_sequence"] is None
    [delta] = [d for n, d in frames if n == "message_delta"]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    streamed = "".join(d["delta"]["text"] for n, d in frames if n == "content_block_delta")
    assert streamed == before

    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    with claude.messages.stream(model=GREEDY, max_tokens=16, messages=HI, stop_sequences=[stop],
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_other_endings_keep_stop_sequence_null_and_chat_says_stop(live, stop_case):
    stop, before = stop_case
    url = live[0]
    body = httpx.post(url + MSG, json=claude_body(max_tokens=3, stop_sequences=["never!"]),
                      timeout=60).json()
    assert (body["stop_reason"], body["stop_sequence"]) == ("max_tokens", None)
    chat = httpx.post(url + CHAT, json={"model": GREEDY, "max_tokens": 16, "temperature": 0,
                                        "messages": HI, "stop": stop}, timeout=60).json()
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == before
