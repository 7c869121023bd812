"""Request bodies as real coding agents send them (Claude Code, Codex, opencode / the OpenAI SDK),
over real HTTP on the tiny model: every field they add is accepted, and the event sequences
they parse are complete and in order."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from test_server_support import live_server, sse

MODEL = "deepseek-v4-flash"  # what the README tells agent users to set


@pytest.fixture(scope="module")
def live():
    with live_server(ctx=4096, ping_interval_s=1.0) as (url, runtime):
        yield url, runtime


def post_stream(url: str, body: dict, headers: dict | None = None) -> list:
    r = httpx.post(url, json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return sse(r.text)


# ---- Claude Code -------------------------------------------------------------------------

CACHE = {"type": "ephemeral"}
BASH = {"name": "Bash", "description": "Executes a bash command.", "input_schema": {
    "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
    "properties": {"command": {"type": "string", "description": "The command to run"},
                   "timeout": {"type": "number"}},
    "required": ["command"], "additionalProperties": False}}
READ = {"name": "Read", "description": "Reads a file.", "cache_control": CACHE, "input_schema": {
    "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
    "properties": {"file_path": {"type": "string"}}, "required": ["file_path"],
    "additionalProperties": False}}
CLAUDE_HEADERS = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                    "fine-grained-tool-streaming-2025-05-14",
                  "anthropic-version": "2023-06-01", "x-api-key": "unused", "x-app": "cli",
                  "anthropic-dangerous-direct-browser-access": "true"}
CLAUDE_SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
     "cache_control": CACHE},
    {"type": "text", "text": "You are an interactive CLI tool that helps users with software "
                             "engineering tasks.", "cache_control": CACHE}]
USE_ID = "toolu_0123456789abcdef0123456789abcdef"
USE_ID2 = "toolu_fedcba9876543210fedcba9876543210"


def claude_body(messages: list) -> dict:
    return {"model": MODEL, "max_tokens": 8, "stream": True, "system": CLAUDE_SYSTEM,
            "messages": messages, "tools": [BASH, READ], "temperature": 1,
            "metadata": {"user_id": "user_0123_account__session_4567"},
            "thinking": {"type": "enabled", "budget_tokens": 1024}}


FIRST_TURN = [{"role": "user", "content": [
    {"type": "text", "text": "<system-reminder>This is a reminder.</system-reminder>"},
    {"type": "text", "text": "List the files here.", "cache_control": CACHE}]}]
FOLLOW_UP = FIRST_TURN + [
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should run ls.", "signature": "sig-abc=="},
        {"type": "text", "text": "I'll list them."},
        {"type": "tool_use", "id": USE_ID, "name": "Bash", "input": {"command": "ls"}},
        {"type": "tool_use", "id": USE_ID2, "name": "Read", "input": {"file_path": "/x"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": USE_ID, "content": "README.md\nsetup.py"},
        {"type": "tool_result", "tool_use_id": USE_ID2, "is_error": True,
         "content": [{"type": "text", "text": "File does not exist."}]},
        {"type": "text", "text": "Thanks", "cache_control": CACHE}]}]


def check_message_events(frames: list) -> dict:
    """message_start, (content_block_start, deltas, content_block_stop)+, message_delta,
    message_stop (pings anywhere); returns the message_delta."""
    names = [n for n, _ in frames if n != "ping"]
    data = [d for n, d in frames if n != "ping"]
    assert all(d["type"] == n for n, d in zip(names, data))
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = data[0]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["model"] == MODEL
    assert start["stop_reason"] is None
    blocks, open_index = [], None
    for name, d in zip(names[1:-2], data[1:-2]):
        if name == "content_block_start":
            assert open_index is None and d["index"] == len(blocks)
            open_index = d["index"]
            blocks.append(d["content_block"]["type"])
        elif name == "content_block_delta":
            assert d["index"] == open_index
        else:
            assert name == "content_block_stop" and d["index"] == open_index
            open_index = None
    assert blocks and open_index is None
    delta = data[-2]
    assert delta["delta"]["stop_reason"] == "max_tokens"  # 8 tokens of a random model
    assert delta["usage"]["output_tokens"] == 8
    return delta


def test_claude_code_turns(live):
    base = live[0]
    url = base + "/v1/messages?beta=true"
    first = post_stream(url, claude_body(FIRST_TURN), CLAUDE_HEADERS)
    check_message_events(first)
    follow = post_stream(url, claude_body(FOLLOW_UP), CLAUDE_HEADERS)
    check_message_events(follow)
    # it counts tokens of the same body, and sends small-model requests unstreamed
    counted = httpx.post(base + "/v1/messages/count_tokens?beta=true", headers=CLAUDE_HEADERS,
                         json={k: v for k, v in claude_body(FOLLOW_UP).items()
                               if k in ("model", "system", "messages", "tools", "thinking")})
    assert counted.status_code == 200
    start = next(d for n, d in follow if n == "message_start")["message"]["usage"]
    assert counted.json()["input_tokens"] == (start["input_tokens"] + start[
        "cache_read_input_tokens"] + start["cache_creation_input_tokens"])
    quick = {**claude_body(FIRST_TURN), "stream": False, "thinking": {"type": "disabled"}}
    r = httpx.post(url, json=quick, headers=CLAUDE_HEADERS, timeout=60)
    assert r.status_code == 200 and [b["type"] for b in r.json()["content"]] == ["text"]
    # without ANTHROPIC_MODEL it would send a Claude model id: refused, in Anthropic's shape
    r = httpx.post(url, json={**quick, "model": "claude-sonnet-4-5-20250929"},
                   headers=CLAUDE_HEADERS)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# ---- Codex -------------------------------------------------------------------------------

CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Runs a shell command.",
     "strict": False, "parameters": {
         "type": "object", "additionalProperties": False, "required": ["command"],
         "properties": {"command": {"type": "array", "items": {"type": "string"}},
                        "workdir": {"type": "string"}, "timeout_ms": {"type": "number"}}}},
    {"type": "custom", "name": "apply_patch", "description": "Applies a patch.",
     "format": {"type": "grammar", "syntax": "lark",
                "definition": 'start: "*** Begin Patch" LF "*** End Patch"'}},
    {"type": "local_shell"},
    {"type": "web_search"},
]
CODEX_INPUT = [
    {"type": "message", "role": "developer",
     "content": [{"type": "input_text", "text": "<permissions instructions>sandboxed"
                                                "</permissions instructions>"}]},
    {"type": "message", "role": "user",
     "content": [{"type": "input_text", "text": "<environment_context><cwd>/repo</cwd>"
                                                "</environment_context>"}]},
    {"type": "message", "role": "user",
     "content": [{"type": "input_text", "text": "What is in this repo?"}]},
    {"type": "reasoning", "id": "rs_0123", "summary": [
        {"type": "summary_text", "text": "Listing files."}], "content": None,
     "encrypted_content": "gAAAAABo-opaque-blob"},
    {"type": "function_call", "id": "fc_0123", "name": "shell", "call_id": "call_abc",
     "arguments": "{\"command\":[\"ls\"]}"},
    {"type": "function_call_output", "call_id": "call_abc", "output": "README.md\nsrc"},
]


def codex_body() -> dict:
    return {"model": MODEL, "instructions": "You are Codex, a coding agent.",
            "input": CODEX_INPUT, "tools": CODEX_TOOLS, "tool_choice": "auto",
            "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0199a2b4-5c6d-7e8f-9012-3456789abcde",
            "text": {"verbosity": "medium"}, "max_output_tokens": 8}


def test_codex_turn(live):
    frames = post_stream(live[0] + "/v1/responses", codex_body(),
                         {"authorization": "Bearer unused", "originator": "codex_cli_rs",
                          "session_id": "0199a2b4"})
    events = [d for _, d in frames]
    assert [name for name, _ in frames] == [e["type"] for e in events]  # `event:` lines
    sdk = TypeAdapter(ResponseStreamEvent)
    assert [sdk.validate_python(e).type for e in events] == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] == "response.incomplete"  # 8 tokens: still reasoning
    added = {e["output_index"]: e["item"]["id"] for e in events
             if e["type"] == "response.output_item.added"}
    done = {e["output_index"]: e["item"]["id"] for e in events
            if e["type"] == "response.output_item.done"}
    assert added and added == done  # every item added is done
    final = events[-1]["response"]
    assert [item["id"] for item in final["output"]] == [added[i] for i in sorted(added)]
    assert final["usage"]["output_tokens"] == 8
    # it asked for summaries and for encrypted reasoning: the reasoning item has both
    reasoning = final["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["summary"][0]["text"]
    assert reasoning["encrypted_content"]


def test_codex_resumes_a_turn_cut_at_max_output_tokens(live):
    """`codex exec resume` sends the cut turn's output items back as they came, status
    "incomplete" included: the next turn is answered, and reuses the first turn's tokens."""
    first = httpx.post(live[0] + "/v1/responses", json={**codex_body(), "stream": False},
                       timeout=120).json()
    assert first["status"] == "incomplete"
    assert "incomplete" in {item["status"] for item in first["output"]}
    again = {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Go on."}]}
    body = {**codex_body(), "stream": False, "input": CODEX_INPUT + first["output"] + [again]}
    r = httpx.post(live[0] + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"]
    bad = {**body, "input": [{**again, "status": 3}]}
    assert httpx.post(live[0] + "/v1/responses", json=bad, timeout=120).status_code == 400


# ---- opencode / the OpenAI SDK -----------------------------------------------------------

OC_TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"filePath": {"type": "string"}},
                   "required": ["filePath"], "additionalProperties": False,
                   "$schema": "http://json-schema.org/draft-07/schema#"}}}]
OC_MESSAGES = [
    {"role": "system", "content": "You are opencode, an interactive CLI agent."},
    {"role": "user", "content": [{"type": "text", "text": "Read the README"}]},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_0123456789abcdef0123456789abcdef", "type": "function",
        "function": {"name": "read", "arguments": "{\"filePath\":\"README.md\"}"}}]},
    {"role": "tool", "tool_call_id": "call_0123456789abcdef0123456789abcdef",
     "content": [{"type": "text", "text": "# ds4\nA port."}]},
    {"role": "user", "content": [{"type": "text", "text": "Summarize it."}]},
]


def test_opencode_chat_stream(live):
    client = openai.OpenAI(base_url=live[0] + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=OC_MESSAGES, tools=OC_TOOLS, tool_choice="auto", stream=True,
        stream_options={"include_usage": True}, max_completion_tokens=8,
        extra_body={"reasoning_effort": "high"}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and not any(finals[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 8
