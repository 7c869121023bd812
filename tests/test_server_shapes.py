"""Protocol shapes of the server, fed with real parser events (no model, no HTTP)."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from ds4.chat import OutputParser, ParsedOutput, render_chat
from ds4.jobs.events import (
    Failed,
    Finished,
    Progress,
    SamplingOptions,
    TokenEvents,
    Usage,
)
from ds4.server.anthropic import MessageShape
from ds4.server.completions import CompletionShape
from ds4.server.config import ServerConfig
from ds4.server.generation import stream_frames
from ds4.server.openai_chat import ChatShape
from ds4.server.responses import ResponseShape
from ds4.server.runtime import Running, Runtime
from ds4.server.sse import COMMENT_PING, DONE
from ds4.server.turn import Prompt, Turn
from ds4.tokenizer import EOS_ID, Tokenizer

D = "｜DSML｜"
TOOL_TURN = (f'I need the get_weather tool.</think>\n\n<{D}tool_calls>\n'
             f'<{D}invoke name="get_weather">\n'
             f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
             f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
             f'</{D}tool_calls>')
TEXT_TURN = "Let me think.</think>The answer is 42."
ARGS = {"city": "Paris", "days": 2}


def job_events(text: str, finish: str, thinking: bool = True, prefix: str = "call_"):
    """TokenEvents of `text` fed 3 bytes at a time, and the Finished event."""
    parser = OutputParser(thinking=thinking, tools_active=True, id_prefix=prefix)
    data = text.encode()
    events = [TokenEvents(7, tuple(parser.feed(data[i:i + 3]))) for i in range(0, len(data), 3)]
    events.append(TokenEvents(7, tuple(parser.finish())))
    return events, Finished(finish, parser.result(), text, Usage(10, 4, len(events)))


def running(stop=(), include_usage=True):
    turn = Turn(endpoint="/x", protocol="openai", model="deepseek-v4-flash", render=lambda: "",
                thinking="high", sampling=SamplingOptions(), max_tokens=100, stop=list(stop),
                include_usage=include_usage)
    engine = SimpleNamespace(tokenizer=Tokenizer.for_model())
    return SimpleNamespace(turn=turn, prompt=Prompt("", list(range(10))),
                           runtime=SimpleNamespace(engine=engine))


def stream(shape, events, finished):
    frames = shape.opening()
    for e in events:
        frames += shape.tokens(e)
    return frames + shape.closing(finished)


def parse_frames(frames):
    """[(event name or None, data)] of SSE frames; data is JSON or the string [DONE]."""
    out = []
    for frame in frames:
        text = frame.decode()
        assert text.endswith("\n\n")
        name = re.search(r"^event: (.*)$", text, re.MULTILINE)
        data = re.search(r"^data: (.*)$", text, re.MULTILINE).group(1)
        out.append((name and name.group(1), data if data == "[DONE]" else json.loads(data)))
    return out


def test_chat_stream_streams_reasoning_and_tool_arguments_then_usage_and_done():
    events, finished = job_events(TOOL_TURN, "tool_calls")
    frames = parse_frames(stream(ChatShape(running()), events, finished))
    assert frames[-1] == (None, "[DONE]")
    chunks = [d for _, d in frames[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I need the get_weather tool."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    header = calls[0]
    assert re.fullmatch(r"call_[0-9a-f]{32}", header["id"]) and header["type"] == "function"
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == ARGS
    assert header["id"] == finished.output.tool_calls[0].id
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "tool_calls"}
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 10, "completion_tokens": finished.usage.completion_tokens,
        "total_tokens": 10 + finished.usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 6},
        "completion_tokens_details": {"reasoning_tokens": 0}}


def test_chat_body_has_message_reasoning_and_tool_calls():
    _, finished = job_events(TOOL_TURN, "tool_calls")
    body = ChatShape(running()).body(finished)
    assert body["object"] == "chat.completion" and body["model"] == "deepseek-v4-flash"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["role"] == "assistant" and msg["content"] == ""
    assert msg["reasoning_content"] == "I need the get_weather tool."
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == ARGS


def test_anthropic_stream_has_thinking_signature_and_tool_use_blocks():
    events, finished = job_events(TOOL_TURN, "tool_calls", prefix="toolu_")
    shape = MessageShape(running())
    frames = parse_frames(stream(shape, events, finished))
    names = [n for n, _ in frames]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"] for n, d in frames if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "tool_use"]
    assert re.fullmatch(r"toolu_[0-9a-f]{32}", starts[1]["id"]) and starts[1]["input"] == {}
    deltas = [d["delta"] for n, d in frames if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "I need the get_weather tool."
    assert [d["signature"] for d in deltas if d["type"] == "signature_delta"] == [shape.id]
    assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == ARGS
    stops = [d["index"] for n, d in frames if n == "content_block_stop"]
    assert stops == [0, 1]
    delta = frames[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    u = delta["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == 10


def test_anthropic_body_orders_blocks_and_parses_input():
    _, finished = job_events(TOOL_TURN, "tool_calls", prefix="toolu_")
    shape = MessageShape(running())
    body = shape.body(finished)
    assert [b["type"] for b in body["content"]] == ["thinking", "tool_use"]
    assert body["content"][0]["signature"] == shape.id
    assert body["content"][1]["input"] == ARGS and body["stop_reason"] == "tool_use"
    assert body["usage"] == {"input_tokens": 0, "output_tokens": finished.usage.completion_tokens,
                             "cache_read_input_tokens": 4, "cache_creation_input_tokens": 6}


def test_anthropic_thinking_only_gets_an_empty_text_block():
    events, finished = job_events("still thinking", "length")
    frames = parse_frames(stream(MessageShape(running()), events, finished))
    starts = [d["content_block"]["type"] for n, d in frames if n == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert frames[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_responses_stream_numbers_events_and_ends_with_the_whole_response():
    events, finished = job_events(TEXT_TURN, "stop")
    shape = ResponseShape(running(), summaries=True)
    frames = stream(shape, events, finished)
    data = sdk_events(frames)
    assert [n for n, _ in parse_frames(frames)] == [d["type"] for d in data]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert all(list(d)[:2] == ["type", "sequence_number"] for d in data)
    types = [d["type"] for d in data]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    summary = "".join(d["delta"] for d in data
                      if d["type"] == "response.reasoning_summary_text.delta")
    text = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    assert (summary, text) == ("Let me think.", "The answer is 42.")
    final = data[-1]["response"]
    assert final["status"] == "completed" and final["id"].startswith("resp_")
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"] == [{"type": "output_text", "text": "The answer is 42.",
                                              "annotations": []}]
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 4, "cache_write_tokens": 6}


def test_responses_body_without_summary_opt_in_has_function_call_only():
    _, finished = job_events(TOOL_TURN, "tool_calls")
    body = ResponseShape(running(), summaries=False).body(finished)
    [call] = body["output"]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["call_id"] == finished.output.tool_calls[0].id and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == ARGS


PATCH = '*** Begin Patch\n*** Add File: a.txt\n+say "hi" \\ bye\n*** End Patch'
CODEX_TURN = (f'Patch, then list.</think>\n\n<{D}tool_calls>\n<{D}invoke name="apply_patch">\n'
              f'<{D}parameter name="input" string="true">{PATCH}</{D}parameter>\n</{D}invoke>\n'
              f'<{D}invoke name="local_shell">\n'
              f'<{D}parameter name="command" string="false">["ls", "-la"]</{D}parameter>\n'
              f'</{D}invoke>\n</{D}tool_calls>')
CODEX_BODY = {"tools": [
    {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}},
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'}},
    {"type": "local_shell"}, {"type": "web_search"}], "tool_choice": "auto"}
SDK_EVENT = TypeAdapter(ResponseStreamEvent)


def sdk_events(frames):
    """The data of Responses SSE frames, each checked against the openai SDK's event models."""
    data = [d for _, d in parse_frames(frames)]
    for d in data:
        assert SDK_EVENT.validate_python(d).type == d["type"]
    return data


def test_responses_custom_tool_and_local_shell_calls_stream_as_their_own_items():
    events, finished = job_events(CODEX_TURN, "tool_calls")
    data = sdk_events(stream(ResponseShape(running(), False, CODEX_BODY), events, finished))
    patch_id, shell_id = [c.id for c in finished.output.tool_calls]
    kinds = [d["type"] for d in data]
    deltas = [d["delta"] for d in data if d["type"] == "response.custom_tool_call_input.delta"]
    assert len(deltas) > 1 and "".join(deltas) == PATCH  # streamed as sampled, not at the end
    assert kinds == ["response.created", "response.output_item.added",
                     *["response.custom_tool_call_input.delta"] * len(deltas),
                     "response.custom_tool_call_input.done", "response.output_item.done",
                     "response.output_item.added", "response.output_item.done",
                     "response.completed"]
    added = data[1]["item"]
    assert added == {"id": added["id"], "type": "custom_tool_call", "status": "in_progress",
                     "call_id": patch_id, "name": "apply_patch", "input": ""}
    assert {d["item_id"] for d in data[2:3 + len(deltas)]} == {added["id"]}
    assert data[2 + len(deltas)]["input"] == PATCH
    patch = {**added, "status": "completed", "input": PATCH}
    shell = {"id": data[-3]["item"]["id"], "type": "local_shell_call", "status": "completed",
             "call_id": shell_id, "action": {"type": "exec", "command": ["ls", "-la"], "env": {}}}
    assert [data[-4]["item"], data[-2]["item"]] == [patch, shell]
    assert data[-3]["item"] == {**shell, "status": "in_progress"}
    final = data[-1]["response"]
    assert final["output"] == [patch, shell] and final["tools"] == CODEX_BODY["tools"]


def test_responses_body_has_custom_and_shell_items_and_validates():
    _, finished = job_events(CODEX_TURN, "tool_calls")
    body = ResponseShape(running(), summaries=False, body=CODEX_BODY).body(finished)
    parsed = Response.model_validate(body)
    assert [i.type for i in parsed.output] == ["custom_tool_call", "local_shell_call"]
    assert parsed.output[0].input == PATCH and parsed.output[1].action.command == ["ls", "-la"]


def test_local_shell_call_without_an_argv_stays_a_function_call():
    text = (f'</think>\n\n<{D}tool_calls>\n<{D}invoke name="local_shell">\n'
            f'<{D}parameter name="command" string="true">ls -la</{D}parameter>\n'
            f'</{D}invoke>\n</{D}tool_calls>')
    events, finished = job_events(text, "tool_calls")
    data = sdk_events(stream(ResponseShape(running(), False, CODEX_BODY), events, finished))
    [call] = data[-1]["response"]["output"]
    assert call["type"] == "function_call" and call["name"] == "local_shell"
    assert json.loads(call["arguments"]) == {"command": "ls -la"}


def test_responses_length_is_incomplete():
    _, finished = job_events("no end", "length", thinking=False)
    body = ResponseShape(running(), summaries=False).body(finished)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_completion_stream_never_shows_a_stop_sequence():
    tok = Tokenizer.for_model()
    ids = tok.encode("Hello world STOP and more")
    events = [TokenEvents(i, ()) for i in ids] + [TokenEvents(EOS_ID, ())]
    finished = Finished("stop", None, "Hello world ", Usage(10, 0, len(ids)))
    frames = parse_frames(stream(CompletionShape(running(stop=["STOP"])), events, finished))
    texts = [d["choices"][0]["text"] for _, d in frames[:-1] if d["choices"]]
    assert "".join(texts) == "Hello world " and all("S" not in t for t in texts)
    assert frames[-3][1]["choices"][0]["finish_reason"] == "stop"
    assert frames[-2][1]["choices"] == [] and frames[-1][1] == "[DONE]"


@pytest.mark.parametrize("shape", [ChatShape, MessageShape, CompletionShape])
def test_failure_inside_a_stream_is_an_error_frame(shape):
    frames = parse_frames(shape(running()).failure(Failed("eval failed", 500)))
    name, data = frames[0]
    assert "choices" not in data  # no chunk with an invented finish_reason
    if shape is MessageShape:
        assert name == "error" and data == {"type": "error", "error": {
            "type": "api_error", "message": "eval failed"}}
    else:
        assert data["error"]["message"] == "eval failed"
        assert data["error"]["type"] == "server_error" and frames[-1][1] == "[DONE]"


def test_finished_tool_turn_is_replayed_exactly_in_the_next_prompt():
    runtime = Runtime(ServerConfig())
    _, finished = job_events(TOOL_TURN, "tool_calls")

    async def deliver():
        job = Running(runtime, running().turn, Prompt("", [1]))
        job.events.sink(finished)
        return await job.next(1.0)

    assert asyncio.run(deliver()) is finished
    [call] = finished.output.tool_calls
    raw = finished.output.raw_block
    assert raw and runtime.tool_memory.lookup(call.id) == raw
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": '{"days":2,"city":"Paris"}'}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert raw in render_chat(history, tools=tools, tool_memory=runtime.tool_memory)


def test_pings_keep_coming_while_the_job_only_reports_progress():
    class ProgressOnly:
        """A job that reports a prefill slice every 20 ms, then finishes."""

        def __init__(self):
            self.slices = 0

        async def next(self, timeout):
            if timeout < 0.02:
                await asyncio.sleep(timeout)
                return None
            await asyncio.sleep(0.02)
            self.slices += 1
            if self.slices == 40:
                return Finished("length", ParsedOutput(), "", Usage(10, 0, 0))
            return Progress(self.slices, 100)

        def cancel(self):
            pass

    runtime = SimpleNamespace(config=SimpleNamespace(ping_interval_s=0.1))

    async def frames():
        return [f async for f in stream_frames(runtime, ProgressOnly(), ChatShape(running()), [])]

    got = asyncio.run(frames())
    assert got.count(COMMENT_PING) >= 3 and got[-1] == DONE


def test_completion_stream_shows_no_end_of_sentence_marker():
    ids = Tokenizer.for_model().encode("Hello there")
    events = [TokenEvents(i, ()) for i in ids] + [TokenEvents(EOS_ID, ())]
    finished = Finished("stop", ParsedOutput(), "Hello there", Usage(10, 0, len(ids)))
    frames = parse_frames(stream(CompletionShape(running()), events, finished))
    assert "".join(d["choices"][0]["text"] for _, d in frames[:-1] if d["choices"]) == "Hello there"
