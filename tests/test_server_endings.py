"""How turns end, over real HTTP on the tiny model: stop sequences reported as each protocol
does, and forced tool calls the random model cannot complete (docs/PROTOCOLS.md, Malformed DSML)."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from test_server_support import GREEDY, busy_slots, live_server, sse, wait_idle

HI = [{"role": "user", "content": "Say hi"}]
MSG, CHAT = "/v1/messages", "/v1/chat/completions"


@pytest.fixture(scope="module")
def live():
    # a turn without max_tokens may run to the end of this context: minutes on the tiny model
    with live_server(ctx=32768, ping_interval_s=1.0) as (url, runtime):
        yield url, runtime


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


def test_completions_stop_cuts_the_text_as_sampled(live):
    # /v1/completions continues the prompt and returns the text as sampled: a stop string
    # anywhere in it ends it, streamed or not
    url = live[0] + "/v1/completions"
    body = {"prompt": "Tell me", "max_tokens": 24, "seed": 3}
    free = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    assert len(free) >= 12, free
    stop = free[8:11]
    before = free[: free.find(stop)]
    choice = httpx.post(url, json={**body, "stop": stop}, timeout=60).json()["choices"][0]
    assert (choice["finish_reason"], choice["text"]) == ("stop", before)
    frames = sse(httpx.post(url, json={**body, "stop": [stop], "stream": True}, timeout=60).text)
    chunks = [d["choices"][0] for _, d in frames if d != "[DONE]" and d["choices"]]
    assert "".join(c["text"] for c in chunks) == before
    assert chunks[-1]["finish_reason"] == "stop"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CLAUDE_WEATHER = {"name": "get_weather", "description": "Weather of a city.",
                  "input_schema": WEATHER["function"]["parameters"]}
BLOCK = "\n\n<｜DSML｜tool_calls>\n"
INVOKE = '<｜DSML｜invoke name="get_weather">\n'
# The random tiny model never writes valid DSML after the forced prefix, and greedy redecodes
# repeat its choice: every forced call below is rejected once recovery gives up.
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def chat_body(choice, **extra) -> dict:
    return {"model": GREEDY, "max_tokens": 24, "temperature": 0, "messages": HI,
            "tools": [WEATHER], "tool_choice": choice, **extra}


@pytest.mark.parametrize("choice, forced", [("required", BLOCK), (NAMED, BLOCK + INVOKE)])
def test_rejected_forced_call_comes_back_as_the_raw_text(live, choice, forced):
    done = httpx.post(live[0] + CHAT, json=chat_body(choice), timeout=60).json()
    [choice_out] = done["choices"]
    message = choice_out["message"]
    assert choice_out["finish_reason"] == "stop" and "tool_calls" not in message
    # the whole generated text: the forced bytes, then what the model wrote after them
    assert message["content"].startswith(forced) and len(message["content"]) > len(forced)
    assert done["usage"]["completion_tokens"] > 0


def test_streamed_required_call_without_a_header_ends_with_the_same_text(live):
    url = live[0]
    done = httpx.post(url + CHAT, json=chat_body("required"), timeout=60).json()
    frames = sse(httpx.post(url + CHAT, json=chat_body("required", stream=True),
                            timeout=60).text)
    chunks = [d for _, d in frames if d != "[DONE]"]
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == done["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and frames[-1][1] == "[DONE]"


def test_streamed_named_call_whose_block_is_rejected_ends_with_an_error(live):
    frames = sse(httpx.post(live[0] + CHAT, json=chat_body(NAMED, stream=True),
                            timeout=60).text)
    calls = [c["choices"][0]["delta"]["tool_calls"] for _, c in frames
             if c != "[DONE]" and c.get("choices") and "tool_calls" in c["choices"][0]["delta"]]
    assert calls[0][0]["function"]["name"] == "get_weather"  # the header went out
    error, done = frames[-2:]
    assert set(error[1]) == {"error"} and error[1]["error"]["type"] == "server_error"
    assert error[1]["error"]["message"].startswith("invalid tool call")
    assert done[1] == "[DONE]"


def test_anthropic_forced_tool_text_or_error_event(live):
    url = live[0]
    body = claude_body(max_tokens=24, tools=[CLAUDE_WEATHER],
                       tool_choice={"type": "tool", "name": "get_weather"})
    msg = httpx.post(url + MSG, json=body, timeout=60).json()
    assert msg["stop_reason"] == "end_turn"
    [block] = msg["content"]
    assert block["type"] == "text" and block["text"].startswith(BLOCK + INVOKE)

    frames = sse(httpx.post(url + MSG, json={**body, "stream": True}, timeout=60).text)
    names = [n for n, _ in frames]
    starts = [d["content_block"] for n, d in frames if n == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["name"] == "get_weather"
    assert names[-1] == "error" and "message_stop" not in names
    assert frames[-1][1]["error"]["type"] == "api_error"
    assert frames[-1][1]["error"]["message"].startswith("invalid tool call")


def test_responses_forced_call_rejected_after_its_item_was_added_fails(live):
    body = {"model": GREEDY, "input": "Say hi", "max_output_tokens": 24, "temperature": 0,
            "tools": [{"type": "function", **WEATHER["function"]}],
            "tool_choice": {"type": "function", "name": "get_weather"}}
    done = httpx.post(live[0] + "/v1/responses", json=body, timeout=60).json()
    assert done["status"] == "completed"
    assert [i["type"] for i in done["output"]] == ["message"]
    assert done["output"][0]["content"][0]["text"].startswith(BLOCK + INVOKE)
    frames = sse(httpx.post(live[0] + "/v1/responses", json={**body, "stream": True},
                            timeout=60).text)
    kinds = [d["type"] for _, d in frames]
    assert "response.output_item.added" in kinds and kinds[-1] == "response.failed"
    assert frames[-1][1]["response"]["error"]["message"].startswith("invalid tool call")


def test_responses_forced_custom_tool_streams_a_custom_tool_call_item(live):
    patch = {"type": "custom", "name": "apply_patch", "description": "Edit files."}
    body = {"model": GREEDY, "input": "Say hi", "max_output_tokens": 24, "temperature": 0,
            "tools": [patch], "tool_choice": {"type": "custom", "name": "apply_patch"},
            "stream": True}
    frames = sse(httpx.post(live[0] + "/v1/responses", json=body, timeout=60).text)
    [added] = [d["item"] for _, d in frames if d["type"] == "response.output_item.added"]
    assert added["type"] == "custom_tool_call" and added["name"] == "apply_patch"
    assert added["call_id"].startswith("call_") and added["input"] == ""
    assert not any(d["type"].startswith("response.function_call") for _, d in frames)
    end = frames[-1][1]
    if end["type"] == "response.failed":  # the random model broke the block it was forced into
        assert end["response"]["error"]["message"].startswith("invalid tool call")
    else:
        assert [i["type"] for i in end["response"]["output"]] == ["custom_tool_call"]


UNLIMITED = [  # no max tokens: each would generate until the 32768-token context is full
    (CHAT, {"model": GREEDY, "messages": HI, "temperature": 0, "stream": True}),
    (MSG, {"model": GREEDY, "messages": HI, "temperature": 0, "stream": True}),
    ("/v1/responses", {"model": GREEDY, "input": "Say hi", "temperature": 0, "stream": True}),
]


@pytest.mark.parametrize("path, body", UNLIMITED, ids=["chat", "messages", "responses"])
def test_disconnect_stops_a_stream_without_a_token_limit(live, path, body):
    url = live[0]
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        lines = r.iter_lines()
        while sum("delta" in next(lines) for _ in range(4)) < 2:
            pass
        assert busy_slots(url) != []
    assert wait_idle(url) == []  # only the cancel can end it this soon


def test_non_streamed_client_without_a_token_limit_that_gives_up_stops_its_job(live):
    url = live[0]
    body = {"model": GREEDY, "input": "Say hi", "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/responses", json=body, timeout=1.0)
    assert wait_idle(url) == []
