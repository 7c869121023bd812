"""Protocol details real clients rely on, over real HTTP on the tiny model, checked against the
job trace (`--trace`): Claude Code's in-conversation system messages, reasoning token counts,
one cache split reported by every protocol, Responses encrypted reasoning and named SSE
events, how a failed stream ends, and /v1/completions continuing the prompt as written."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_server_support import GREEDY, live_server, sse

from ds4.engine import Session
from ds4.jobs.trace import read_trace
from ds4.server.sealed_reasoning import PREFIX, ReasoningSeal
from ds4.tokenizer import BOS_ID, Tokenizer

THINKING = "deepseek-v4-flash"  # thinking on by default
HI = [{"role": "user", "content": "Say hi"}]
MSG, CHAT, RESP, COMP = "/v1/messages", "/v1/chat/completions", "/v1/responses", "/v1/completions"
MID_SYSTEM_BETA = {"anthropic-beta": "mid-conversation-system-2026-04-07",
                   "anthropic-version": "2023-06-01"}
ENCRYPTED = ["reasoning.encrypted_content"]
SHELL = {"type": "function", "name": "shell", "description": "Runs a command.",
         "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "jobs.jsonl"
    with live_server(ctx=4096, ping_interval_s=1.0, trace=str(trace)) as (url, runtime):
        yield url, trace


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.for_model()


def post(url: str, body: dict, headers: dict | None = None) -> dict:
    r = httpx.post(url, json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def traced(url: str, trace, path: str, body: dict) -> tuple[httpx.Response, dict]:
    """POST a body; its answer and its job's trace record. The scheduler writes the record
    just after the client got its answer, so wait for one more record of this very body."""
    raw = json.dumps(body)

    def records() -> list[dict]:
        return [r for r in read_trace(trace) if r["raw_request"] == raw]

    before = len(records())
    r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"},
                   timeout=120)
    deadline = time.monotonic() + 30
    while len(mine := records()) <= before:
        assert time.monotonic() < deadline, "the job's trace record never came"
        time.sleep(0.02)
    return r, mine[-1]


# ---- 1. Anthropic: a system message inside `messages` ----------------------------------------

MID_SYSTEM = [
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": [{"type": "text", "text": "Which directory?"}]},
    {"role": "system", "content": [
        {"type": "text", "text": "Plan mode is on: do not edit files.",
         "cache_control": {"type": "ephemeral"}}]},
    {"role": "user", "content": "This one."},
]
MID_SYSTEM_CHAT = [
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": "Which directory?"},
    {"role": "system", "content": "Plan mode is on: do not edit files."},
    {"role": "user", "content": "This one."},
]


def test_claude_code_mid_conversation_system_message_renders_in_place(live):
    url = live[0]
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    msg = claude.messages.create(model=GREEDY, max_tokens=4, messages=MID_SYSTEM,
                                 extra_headers=MID_SYSTEM_BETA)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 4
    # the prompt is the one the OpenAI route renders for a system message at that position
    chat = post(url + CHAT, {"model": GREEDY, "max_tokens": 1, "messages": MID_SYSTEM_CHAT})
    anth = msg.usage
    assert (anth.input_tokens + anth.cache_read_input_tokens + anth.cache_creation_input_tokens
            == chat["usage"]["prompt_tokens"])
    counted = claude.messages.count_tokens(model=GREEDY, messages=MID_SYSTEM,
                                           extra_headers=MID_SYSTEM_BETA)
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]
    without = claude.messages.count_tokens(
        model=GREEDY, messages=[m for m in MID_SYSTEM if m["role"] != "system"])
    assert without.input_tokens < counted.input_tokens
    as_string = [{**m, "content": "Plan mode is on: do not edit files."}
                 if m["role"] == "system" else m for m in MID_SYSTEM]
    assert claude.messages.count_tokens(
        model=GREEDY, messages=as_string).input_tokens == counted.input_tokens


def test_an_unknown_anthropic_role_is_a_400_saying_not_supported(live):
    r = httpx.post(live[0] + MSG, headers=MID_SYSTEM_BETA, json={
        "model": GREEDY, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "message role 'tool' is not supported"}}


# ---- 2. reasoning tokens ---------------------------------------------------------------------

def reasoning_count(record: dict, tok: Tokenizer) -> int:
    """Generated tokens up to and including the one that closes the reasoning."""
    [think_end] = tok.encode("</think>")
    generated = record["generated_tokens"]
    return generated.index(think_end) + 1 if think_end in generated else len(generated)


def test_reasoning_tokens_are_counted_on_chat_and_responses(live, tok):
    url, trace = live
    body = {"model": THINKING, "messages": HI, "max_tokens": 12}
    r, record = traced(url, trace, CHAT, body)
    expected = reasoning_count(record, tok)
    assert expected >= 1  # the turn opened in <think>: its first token is reasoning
    assert record["reasoning_tokens"] == expected
    assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": expected}

    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r, record = traced(url, trace, CHAT, streamed)
    usage = sse(r.text)[-2][1]["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": reasoning_count(record, tok)}

    r, record = traced(url, trace, RESP, {"model": THINKING, "input": "Say hi",
                                          "max_output_tokens": 12})
    usage = r.json()["usage"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": reasoning_count(record, tok)}
    assert 1 <= usage["output_tokens_details"]["reasoning_tokens"] <= usage["output_tokens"]

    off = post(url + CHAT, {"model": GREEDY, "messages": HI, "max_tokens": 4})
    assert off["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


# ---- 3. one cache split for every protocol -----------------------------------------------

def anthropic_split(u: dict) -> tuple[int, int, int]:
    return u["input_tokens"], u["cache_read_input_tokens"], u["cache_creation_input_tokens"]


def test_anthropic_usage_agrees_between_events_and_with_the_openai_split(live):
    url = live[0]
    body = {"model": GREEDY, "max_tokens": 6, "temperature": 0, "messages": HI}
    other = post(url + CHAT, {"model": GREEDY, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Something else entirely"}]})["usage"]
    assert other["prompt_tokens_details"] == {"cached_tokens": 0,
                                              "cache_write_tokens": other["prompt_tokens"]}
    # cold: nothing read, the whole prompt written (Anthropic counts input + read + written)
    cold = post(url + MSG, body)["usage"]
    prompt = sum(anthropic_split(cold))
    assert anthropic_split(cold) == (0, 0, prompt)
    # the same prompt again, streamed: message_start already reports the final split
    frames = sse(httpx.post(url + MSG, json={**body, "stream": True}, timeout=120).text)
    [start] = [d["message"]["usage"] for n, d in frames if n == "message_start"]
    [delta] = [d["usage"] for n, d in frames if n == "message_delta"]
    assert anthropic_split(start) == anthropic_split(delta) == (0, prompt, 0)
    # the chat route renders this very prompt; after the same greedy turn it reads and
    # writes what the Anthropic stream did
    chat = post(url + CHAT, body)["usage"]
    assert chat["prompt_tokens"] == prompt
    assert chat["prompt_tokens_details"] == {"cached_tokens": prompt, "cache_write_tokens": 0}
    # the SDK's own stream reader, on a cold prompt: its message_start and final usage agree
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    edited = [{"role": "user", "content": "Say hi twice"}]
    with claude.messages.stream(model=GREEDY, max_tokens=6, messages=edited) as stream:
        begun = next(e for e in stream if e.type == "message_start").message.usage
        final = stream.get_final_message().usage
    counted = claude.messages.count_tokens(model=GREEDY, messages=edited).input_tokens
    for u in (begun, final):
        assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (
            0, 0, counted)


# ---- 4. Responses encrypted reasoning ---------------------------------------------------

def reasoning_turn(url: str, trace, tok: Tokenizer) -> tuple[dict, dict]:
    """A turn whose sampled tokens are what their text tokenizes to again (the random model's
    text nearly always is), so a byte-identical re-render extends the slot's tokens."""
    body = {"model": THINKING, "input": "List the files.", "tools": [SHELL],
            "max_output_tokens": 6, "include": ENCRYPTED}
    for _ in range(5):
        r, record = traced(url, trace, RESP, body)
        out = r.json()
        generated = record["generated_tokens"]
        if tok.encode(tok.decode(generated)) == generated:
            return out, record
    raise AssertionError("no turn of the random model re-tokenized to its own tokens")


def sent_back(item: dict, **changes) -> dict:
    """An output item as Codex sends it back: no status, summary text left out."""
    return {**{k: v for k, v in item.items() if k != "status"}, **changes}


def test_encrypted_reasoning_restores_the_exact_turn_and_its_prefix(live, tok):
    url, trace = live
    out, first = reasoning_turn(url, trace, tok)
    Response.model_validate(out)
    reasoning = next(i for i in out["output"] if i["type"] == "reasoning")
    assert reasoning["summary"] == [] and isinstance(reasoning["encrypted_content"], str)
    history = [{"type": "message", "role": "user", "content": "List the files."},
               sent_back(reasoning),
               *[sent_back(i) for i in out["output"] if i["type"] == "message"],
               {"type": "message", "role": "user", "content": "And then?"}]
    body = {"model": THINKING, "input": history, "tools": [SHELL], "max_output_tokens": 2,
            "include": ENCRYPTED}
    r, record = traced(url, trace, RESP, body)
    second = r.json()
    held = first["prompt_token_ids"] + first["generated_tokens"]
    # the turn renders byte for byte as it was sampled, so the slot's tokens are reused whole
    assert tok.decode(record["prompt_token_ids"]).startswith(
        tok.decode(first["prompt_token_ids"]) + first["text"])
    assert record["prompt_token_ids"][:len(held)] == held
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == len(held)

    # a changed value opens to nothing: the turn renders as if the item carried none
    sealed = reasoning["encrypted_content"]
    tampered = sealed[:-3] + ("AAA" if sealed[-3:] != "AAA" else "BBB")
    for value in (tampered, "gAAAAABo-opaque-blob", ""):
        changed = [sent_back(i, encrypted_content=value) if i.get("type") == "reasoning" else i
                   for i in history]
        got = post(url + RESP, {**body, "input": changed})
        without = post(url + RESP, {**body, "input": [i for i in history
                                                      if i.get("type") != "reasoning"]})
        assert got["usage"]["input_tokens"] == without["usage"]["input_tokens"]
        assert got["usage"]["input_tokens"] == second["usage"]["input_tokens"] - len(
            first["generated_tokens"])


def test_a_summary_sent_back_with_its_encrypted_reasoning_renders_once(live):
    url = live[0]
    body = {"model": THINKING, "input": "Say hi", "tools": [SHELL], "max_output_tokens": 4,
            "reasoning": {"summary": "auto"}, "include": ENCRYPTED}
    out = post(url + RESP, body)
    reasoning = next(i for i in out["output"] if i["type"] == "reasoning")
    assert reasoning["summary"][0]["text"] and reasoning["encrypted_content"]

    def input_tokens(item: dict) -> int:
        history = [{"type": "message", "role": "user", "content": "Say hi"}, item,
                   {"type": "message", "role": "user", "content": "Go on"}]
        return post(url + RESP, {**body, "input": history,
                                 "max_output_tokens": 1})["usage"]["input_tokens"]

    both = input_tokens(sent_back(reasoning))
    assert both == input_tokens(sent_back(reasoning, summary=[]))
    assert both == input_tokens({k: v for k, v in sent_back(reasoning).items()
                                 if k != "encrypted_content"})


def test_sealed_reasoning_opens_only_under_the_key_that_sealed_it():
    seal = ReasoningSeal()
    text = "Plan: run ls.\n思考 </think> ｜DSML｜ \u00e9" * 20
    sealed = seal.seal(text)
    assert seal.open(sealed) == text and text[:20] not in sealed
    assert ReasoningSeal().open(sealed) is None  # another server process: another key
    cut = sealed[:len(sealed) // 2]
    for bad in (None, 7, "", cut, sealed + "A", PREFIX + "!!!", PREFIX + "é", sealed[6:]):
        assert seal.open(bad) is None, bad


def test_reasoning_items_stream_with_encrypted_content_and_named_events(live):
    url = live[0]
    body = {"model": THINKING, "input": "Say hi", "max_output_tokens": 6, "stream": True,
            "include": ENCRYPTED}
    text = httpx.post(url + RESP, json=body, timeout=120).text
    frames = [f for f in text.split("\n\n") if f]
    adapter = TypeAdapter(ResponseStreamEvent)
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = adapter.validate_json(data[6:])
        assert event.type == name[7:]
        events.append(event)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[0].type == "reasoning" and done[0].encrypted_content
    final = events[-1].response
    assert final.output[0].encrypted_content == done[0].encrypted_content
    # the official SDK's stream reader takes the same frames
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with client.responses.stream(model=THINKING, input="Say hi", max_output_tokens=4,
                                 include=ENCRYPTED) as stream:
        items = [e.item for e in stream if e.type == "response.output_item.done"]
    assert items[0].type == "reasoning" and items[0].encrypted_content


# ---- 6. a stream that fails after it started ------------------------------------------------

FORCED = {"model": GREEDY, "max_tokens": 24, "temperature": 0, "messages": HI, "stream": True,
          "tools": [{"type": "function", "function": {
              "name": "get_weather", "description": "Weather of a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}


def assert_openai_error_ending(frames: list, message: str) -> None:
    """An error object in a data frame, then [DONE]; no chunk says finish_reason "error"."""
    *chunks, (_, error), (_, done) = frames
    assert done == "[DONE]"
    assert set(error) == {"error"} and error["error"]["type"] == "server_error"
    assert error["error"]["message"].startswith(message)
    assert all(c["choices"][0]["finish_reason"] is None for _, c in chunks if c["choices"])


def test_a_chat_stream_whose_announced_call_breaks_ends_with_an_error_frame(live):
    # the random model breaks the block it is forced into, after its header went out
    url, trace = live
    r, record = traced(url, trace, CHAT, FORCED)
    frames = sse(r.text)
    assert any("tool_calls" in d["choices"][0]["delta"] for _, d in frames[:-2] if d["choices"])
    assert_openai_error_ending(frames, "invalid tool call")
    assert record["finish_reason"] == "error"
    assert record["error"].startswith("invalid tool call")
    # unstreamed, the same turn is the text it wrote (nothing was announced)
    r, record = traced(url, trace, CHAT, {**FORCED, "stream": False})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert (record["finish_reason"], record["error"]) == ("stop", None)


@pytest.fixture
def decode_fails_at_third_token(monkeypatch):
    calls = {"n": 0}
    decode = Session.decode

    def failing(self, token_id):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return decode(self, token_id)

    monkeypatch.setattr(Session, "decode", failing)


@pytest.mark.parametrize("path, body", [
    (CHAT, {"model": GREEDY, "messages": HI, "max_tokens": 8, "stream": True}),
    (COMP, {"model": GREEDY, "prompt": "Once upon a time", "max_tokens": 8, "stream": True}),
])
def test_a_stream_that_fails_after_it_started_ends_with_an_error_frame(
        live, path, body, decode_fails_at_third_token):
    url, trace = live
    r, record = traced(url, trace, path, body)
    frames = sse(r.text)
    texts = [d["choices"][0].get("text") or d["choices"][0]["delta"].get("content")
             for _, d in frames[:-2] if d["choices"]]
    assert any(texts)  # tokens went out before the failure
    assert_openai_error_ending(frames, "RuntimeError: device lost")
    assert (record["finish_reason"], record["error"]) == ("error", "RuntimeError: device lost")


# ---- 7. /v1/completions continues the prompt as written --------------------------------------

def test_completions_continue_the_prompt_as_written(live, tok):
    url, trace = live
    prompt = "Once upon a time"
    ids = tok.encode(prompt)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    done = client.completions.create(model=THINKING, prompt=prompt, max_tokens=6, temperature=0)
    assert done.usage.prompt_tokens == len(ids) + 1
    assert done.usage.completion_tokens_details.reasoning_tokens == 0
    # vLLM's other prompt forms give the same prompt, hence the same greedy text
    for same in (prompt, [prompt], ids, [ids], [BOS_ID, *ids]):
        r, record = traced(url, trace, COMP, {"model": THINKING, "prompt": same,
                                              "max_tokens": 6, "temperature": 0})
        assert r.json()["usage"]["prompt_tokens"] == len(ids) + 1
        assert r.json()["choices"][0]["text"] == done.choices[0].text
        assert record["prompt_token_ids"] == [BOS_ID, *ids]
        assert record["thinking"] is False and record["sampling"]["temperature"] == 0


@pytest.mark.parametrize("prompt, words", [
    (["one", "two"], "several prompts"), ([], "several prompts"), ([[]], "token ids"),
    ([5, -1], "token ids"), ([10 ** 9], "token ids"), ([1.5], "token ids"),
    ([True], "token ids"), ([None], "token ids"), ([[1, "a"]], "token ids"),
])
def test_prompts_that_cannot_be_continued_are_a_400(live, prompt, words):
    r = httpx.post(live[0] + COMP, json={"model": GREEDY, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and words in error["message"]
