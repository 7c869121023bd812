"""The server over real HTTP (uvicorn on 127.0.0.1, tiny model) through the openai and anthropic
clients, plus a table of bad requests. Greedy, thinking off (model alias deepseek-chat) wherever
outputs are compared."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest
from test_server_support import GREEDY, free_port, live_server

from ds4.chat import render_anthropic, render_chat

HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def live():
    with live_server(parallel=2, ctx=2048, ping_interval_s=1.0) as (url, runtime):
        yield url, runtime


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live[0] + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(live):
    return anthropic.Anthropic(base_url=live[0], api_key="none", max_retries=0)


def n_tokens(runtime, text: str) -> int:
    return len(runtime.engine.tokenizer.encode(text))


def test_health_slots_and_metrics(live):
    url, _ = live
    health = httpx.get(url + "/health").json()
    assert health == {"status": "ok", "model_fingerprint": health["model_fingerprint"]}
    assert len(health["model_fingerprint"]) == 32
    slots = httpx.get(url + "/slots").json()["slots"]
    assert [s["id"] for s in slots] == [0, 1]
    assert all(set(s) >= {"busy", "tokens", "last_used"} for s in slots)
    text = httpx.get(url + "/metrics").text
    for name in ("ds4_queue_depth", "ds4_busy_slots", "ds4_prompt_tokens_total",
                 "ds4_generated_tokens_total", "ds4_time_to_first_token_seconds_bucket",
                 "ds4_inter_token_seconds_bucket"):
        assert name in text


def test_the_base_url_answers_a_probe(live):
    url = live[0]
    assert httpx.head(url + "/").status_code == 200  # Claude Code's first request
    root = httpx.get(url + "/").json()
    assert root["name"] == "ds4-server" and "deepseek-v4-flash" in root["models"]
    assert {"/v1/messages", "/v1/chat/completions", "/health"} <= set(root["routes"])
    assert httpx.post(url + "/").status_code == 404  # (only GET and HEAD)


def test_models(oai):
    assert {m.id for m in oai.models.list()} == {"deepseek-v4-flash", "deepseek-chat",
                                                 "deepseek-reasoner"}
    card = oai.models.retrieve("deepseek-v4-flash").model_dump()
    assert card["object"] == "model" and card["context_length"] == 2048
    assert card["top_provider"]["max_completion_tokens"] == 2048
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


def test_chat_non_stream_and_stream_agree(oai, live):
    runtime = live[1]
    done = oai.chat.completions.create(model=GREEDY, messages=HI, max_tokens=8, temperature=0)
    assert done.id.startswith("chatcmpl-") and done.object == "chat.completion"
    assert done.model == GREEDY and isinstance(done.created, int)
    choice = done.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    prompt = n_tokens(runtime, render_chat(HI, thinking="none"))
    assert done.usage.prompt_tokens == prompt
    assert done.usage.total_tokens == prompt + done.usage.completion_tokens
    assert done.usage.completion_tokens == 8  # a random model does not end on its own

    chunks = list(oai.chat.completions.create(model=GREEDY, messages=HI, max_tokens=8,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == prompt
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens


def test_completions(oai):
    done = oai.completions.create(model=GREEDY, prompt="Once upon a time", max_tokens=6,
                                  temperature=0)
    assert done.object == "text_completion" and done.id.startswith("cmpl-")
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
    streamed = list(oai.completions.create(model=GREEDY, prompt="Once upon a time", max_tokens=6,
                                           temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_0123456789abcdef0123456789abcdef", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_0123456789abcdef0123456789abcdef",
     "content": "{\"temp_c\": 21}"},
]


def test_chat_with_tools_and_tool_results_in_history(oai, live):
    done = oai.chat.completions.create(model=GREEDY, messages=TOOL_HISTORY, tools=[WEATHER],
                                       max_tokens=6, temperature=0)
    expected = render_chat(TOOL_HISTORY, tools=[WEATHER], thinking="none")
    assert "<tool_result>" in expected and "get_weather" in expected
    assert done.usage.prompt_tokens == n_tokens(live[1], expected)
    assert done.choices[0].finish_reason == "length" and not done.choices[0].message.tool_calls


def test_anthropic_messages_stream_and_count_tokens(claude, live):
    # this anthropic client no longer takes `temperature` as an argument; the API does
    args = {"model": GREEDY, "max_tokens": 8, "messages": HI, "extra_body": {"temperature": 0}}
    msg = claude.messages.create(**args)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == GREEDY
    assert msg.id.startswith("msg_") and msg.stop_sequence is None
    assert msg.stop_reason == "max_tokens"
    assert [b.type for b in msg.content] == ["text"]
    prompt = n_tokens(live[1], render_anthropic(HI, thinking="none"))
    assert claude.messages.count_tokens(model=GREEDY, messages=HI).input_tokens == prompt
    u = msg.usage  # Anthropic counts a prompt as input + cache read + cache written
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == prompt
    assert u.output_tokens == 8

    with claude.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[0].text == msg.content[0].text
    assert final.stop_reason == msg.stop_reason
    u = final.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == prompt


def test_responses_non_stream_and_stream_agree(oai):
    args = {"model": GREEDY, "input": "Say hi", "max_output_tokens": 8, "temperature": 0}
    done = oai.responses.create(**args)
    assert done.id.startswith("resp_") and done.object == "response"
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in done.output] == ["message"]
    events = list(oai.responses.create(stream=True, **args))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type == "response.incomplete"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == done.output_text == events[-1].response.output_text


def too_long() -> list[dict]:
    return [{"role": "user", "content": "hello " * 3000}]


IMAGE_CHAT = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
IMAGE_CLAUDE = [{"role": "user", "content": [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]
CHAT, MSG = "/v1/chat/completions", "/v1/messages"
BAD = [  # (method, path, body (str = raw), status, message fragment)
    ("POST", CHAT, "{not json", 400, "invalid JSON request"),
    ("POST", CHAT, "[1, 2]", 400, "invalid JSON request"),
    ("POST", CHAT, {"model": GREEDY}, 400, "missing messages"),
    ("POST", CHAT, {"messages": HI, "temperature": "hot"}, 400, "temperature"),
    ("POST", CHAT, {"messages": HI, "model": "gpt-4o"}, 404, "gpt-4o"),
    ("POST", CHAT, {"messages": IMAGE_CHAT}, 400, ""),
    ("POST", CHAT, {"messages": too_long()}, 400, "context size is 2048"),
    ("POST", CHAT, {"messages": HI, "tools": [WEATHER],
                    "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, ""),
    ("POST", "/v1/completions", {"max_tokens": 3}, 400, "missing prompt"),
    ("POST", "/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, 400,
     "previous_response_id"),
    ("POST", MSG, "{not json", 400, "invalid JSON request"),
    ("POST", MSG, {"max_tokens": 4}, 400, "missing messages"),
    ("POST", MSG, {"max_tokens": 4, "messages": IMAGE_CLAUDE}, 400, ""),
    ("POST", MSG, {"max_tokens": 4, "messages": too_long()}, 400, "context size is 2048"),
    ("POST", MSG + "/count_tokens", {"messages": HI, "model": "claude-x"}, 404, "claude-x"),
    ("POST", CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', 400,
     "invalid JSON request"),
    ("POST", MSG, '{"max_tokens": 4, "messages": [], "top_p": Infinity}', 400,
     "invalid JSON request"),
    ("GET", CHAT, None, 404, "unknown endpoint"),
    ("POST", "/v1/nowhere", {}, 404, "unknown endpoint"),
]


def test_bad_requests_get_their_status_and_protocol_shape(live):
    url = live[0]
    for method, path, body, status, fragment in BAD:
        content = body if isinstance(body, str) else json.dumps(body) if body else None
        r = httpx.request(method, url + path, content=content)
        assert r.status_code == status, (path, body, r.text)
        got = r.json()
        if path.startswith(MSG):
            assert got["type"] == "error" and set(got["error"]) >= {"type", "message"}
            error = got["error"]
        else:
            error = got["error"]
            assert set(error) >= {"message", "type", "param", "code"}
        assert fragment in error["message"], (path, error)
        if "context size" in fragment:
            assert error["n_ctx"] == 2048 and error["n_prompt_tokens"] > 2048
            if path.startswith(MSG):  # Anthropic's words, which Claude Code compacts on
                words = re.match(r"prompt is too long: (\d+) tokens > (\d+) maximum",
                                 error["message"])
                assert words and words.groups() == (str(error["n_prompt_tokens"]), "2048")
            else:
                assert error["message"].startswith("Prompt has ")
    ok = httpx.post(url + CHAT, json={"model": GREEDY, "messages": HI, "max_tokens": 2})
    assert ok.status_code == 200  # the server keeps serving


def test_out_of_range_sampling_knobs_are_answered_not_a_500(live):
    url = live[0]
    for knob in ({"min_p": 2}, {"seed": -1}):
        body = {"model": GREEDY, "messages": HI, "max_tokens": 2, "temperature": 0.7, **knob}
        r = httpx.post(url + CHAT, json=body)
        assert r.status_code == 200, (knob, r.text)


def metric(url: str, name: str) -> float:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def test_metrics_and_slots_after_generation(live):
    url = live[0]
    names = ("ds4_generated_tokens_total", "ds4_prompt_tokens_total",
             "ds4_time_to_first_token_seconds_count", "ds4_inter_token_seconds_count",
             'ds4_requests_total{endpoint="/v1/messages"')
    before = {name: metric(url, name) for name in names}
    chat = httpx.post(url + CHAT, json={"model": GREEDY, "messages": HI, "max_tokens": 5,
                                        "temperature": 0}).json()["usage"]
    msg = httpx.post(url + MSG, json={"model": GREEDY, "messages": HI, "max_tokens": 5,
                                      "temperature": 0}).json()["usage"]
    grew = {name: metric(url, name) - before[name] for name in names}
    assert grew["ds4_generated_tokens_total"] == chat["completion_tokens"] + msg["output_tokens"]
    msg_prompt = (msg["input_tokens"] + msg["cache_read_input_tokens"]
                  + msg["cache_creation_input_tokens"])
    assert grew["ds4_prompt_tokens_total"] == chat["prompt_tokens"] + msg_prompt
    assert grew["ds4_time_to_first_token_seconds_count"] == 2
    gaps = chat["completion_tokens"] - 1 + msg["output_tokens"] - 1
    assert grew["ds4_inter_token_seconds_count"] == gaps
    assert grew['ds4_requests_total{endpoint="/v1/messages"'] == 1
    slots = httpx.get(url + "/slots").json()["slots"]
    used = [s for s in slots if s["last_used"] is not None]
    assert used and all(abs(s["last_used"] - time.time()) < 600 and s["tokens"] > 0 for s in used)
    assert not any(s["busy"] for s in slots)


def test_api_key_body_limit_cors_and_health_while_loading():
    with live_server(load=False, api_key="sekrit", max_body_bytes=1000, cors=True) as (url, _):
        assert httpx.get(url + "/health").status_code == 503  # model not loaded yet
        r = httpx.post(url + CHAT, json={"messages": HI})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(url + MSG, json={"messages": HI}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        big = {"messages": [{"role": "user", "content": "x" * 2000}]}
        r = httpx.post(url + CHAT, json=big, headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(url + MSG, json=big, headers={"x-api-key": "sekrit"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        r = httpx.post(url + CHAT, json={"messages": HI},
                       headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 503 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.options(url + CHAT)
        assert r.status_code == 204 and "POST" in r.headers["access-control-allow-methods"]


def test_ds4_server_command_prints_address_and_memory_and_serves():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ds4.cli.server", "--port", str(port),
                             "--ctx", "1024", "--parallel", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = []
        for line in proc.stdout:
            out.append(line)
            if "context per slot" in line:
                break
        text = "".join(out)
        assert f"listening on http://127.0.0.1:{port}" in text
        assert "weight_bytes" in text and "2 slot(s)" in text
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{port}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
