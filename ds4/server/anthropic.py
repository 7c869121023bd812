"""POST /v1/messages and /v1/messages/count_tokens (docs/PROTOCOLS.md, Messages)."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response

from ds4.chat import events as ev
from ds4.chat import render_anthropic
from ds4.jobs.events import Failed, Finished, Started, TokenEvents, Usage
from ds4.server import request_fields as rf
from ds4.server.errors import ANTHROPIC, error_body
from ds4.server.generation import failure_error, generate
from ds4.server.openai_object import cache_written
from ds4.server.runtime import Running, Runtime
from ds4.server.sse import Channel, event_frame
from ds4.server.tools import anthropic_result_ids, forced_prefix
from ds4.server.turn import Turn
from ds4.server.wire import json_response, new_id

ENDPOINT = "/v1/messages"
STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
               "cancelled": "end_turn"}
NOT_STOPPED = {"stop_reason": None, "stop_sequence": None}


async def handle(request: Request, runtime: Runtime) -> Response:
    """Serve one message."""
    body, raw = await rf.read_json(request, runtime.config.max_body_bytes)
    runtime.require_serving()
    return await generate(request, runtime, parse(body, raw, runtime), MessageShape)


async def count_tokens(request: Request, runtime: Runtime) -> Response:
    """The prompt length a messages body would have, without running it."""
    body, _ = await rf.read_json(request, runtime.config.max_body_bytes)
    runtime.require_serving()
    model, alias = rf.resolve_model(body)
    thinking = rf.thinking_mode(body, alias, runtime.config.ctx)
    render, _, _ = render_for(body, runtime, thinking)
    turn = Turn(endpoint=ENDPOINT + "/count_tokens", protocol=ANTHROPIC, model=model,
                render=render, thinking=thinking, sampling=rf.sampling({}, "none"), max_tokens=0)
    prompt = await runtime.tokenize(turn)
    return json_response({"input_tokens": len(prompt.tokens)})


def stop_fields(finished: Finished) -> dict:
    """stop_reason and stop_sequence: a matched stop string is reported as Anthropic does."""
    if finished.stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": finished.stop_sequence}
    return {"stop_reason": STOP_REASON.get(finished.finish_reason, "end_turn"),
            "stop_sequence": None}


def usage(u: Usage) -> dict:
    """Anthropic usage: as Anthropic counts, input_tokens + cache_read_input_tokens +
    cache_creation_input_tokens is the prompt length; the read and written shares are the
    ones the OpenAI routes report (cached_tokens, cache_write_tokens)."""
    written = cache_written(u)
    return {"input_tokens": u.prompt_tokens - u.cached_tokens - written,
            "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": written}


def render_for(body: dict, runtime: Runtime, thinking: str):
    """(render callable, tools, choice) of a messages body."""
    messages = rf.required(body, "messages", rf.ARRAY)
    system = rf.field(body, "system", rf.STRING, rf.ARRAY)
    tools = rf.field(body, "tools", rf.ARRAY, default=[])
    choice = rf.field(body, "tool_choice", rf.OBJECT)
    memory = runtime.tool_memory

    def render():
        return render_anthropic(messages, system=system, tools=tools or None,
                                thinking=thinking, tool_choice=choice, tool_memory=memory)

    return render, tools, choice


def parse(body: dict, raw: str, runtime: Runtime) -> Turn:
    """A messages request body as a Turn."""
    cfg = runtime.config
    model, alias = rf.resolve_model(body)
    thinking = rf.thinking_mode(body, alias, cfg.ctx)
    render, tools, choice = render_for(body, runtime, thinking)
    active, forced = forced_prefix(tools, choice)
    return Turn(
        endpoint=ENDPOINT, protocol=ANTHROPIC, model=model, render=render, thinking=thinking,
        sampling=rf.sampling(body, thinking, with_min_p=False, with_seed=False),
        max_tokens=rf.max_tokens(body, ("max_tokens",), cfg.tokens),
        stop=rf.stop_sequences(body, "stop_sequences"), tools_active=active,
        forced_text=forced, id_prefix="toolu_", call_ids=anthropic_result_ids(body["messages"]),
        stream=rf.field(body, "stream", rf.BOOLEAN, default=False), raw_body=raw)


def content_blocks(output, signature: str) -> list[dict]:
    """thinking, text and tool_use blocks; an empty text block when nothing else but thinking."""
    blocks = []
    if output.reasoning:
        blocks.append({"type": "thinking", "thinking": output.reasoning, "signature": signature})
    if output.content or not output.tool_calls:
        blocks.append({"type": "text", "text": output.content})
    for call in output.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                       "input": arguments_object(call.arguments)})
    return blocks


def arguments_object(arguments: str) -> dict:
    """Parsed tool arguments (the parser emits valid JSON; anything else becomes {})."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageShape(ev.ParserEvents[list[bytes]]):
    """Message bodies and the message_start … message_stop event sequence of one job."""

    def __init__(self, running: Running):
        self.turn = running.turn
        self.prompt_tokens = len(running.prompt.tokens)
        self.cached = 0  # prompt tokens the slot reused, known once the job starts
        self.announced = False  # message_start sent
        self.id = new_id("msg_")
        self.thinking = Channel()
        self.text = Channel()
        self.index = -1
        self.open: str | None = None  # type of the open content block
        self.saw = set()  # block types sent
        self.streamed_calls: set[int] = set()

    def message(self, content: list, stop: dict, u: dict) -> dict:
        """The message object; `stop` holds stop_reason and stop_sequence."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.turn.model,
                "content": content, **stop, "usage": u}

    def body(self, finished: Finished) -> dict:
        """The non-streamed message."""
        return self.message(content_blocks(finished.output, self.id), stop_fields(finished),
                            usage(finished.usage))

    def opening(self) -> list[bytes]:
        """Nothing yet: message_start waits for the job's slot, which settles the cache split
        (pings may come first; the SDKs skip them), so it reports the final usage's split."""
        return []

    def started(self, event: Started) -> list[bytes]:
        """message_start, now that the reused prefix is known."""
        self.cached = event.cached_tokens
        return self.message_start()

    def message_start(self) -> list[bytes]:
        """message_start, once, before any other event of the message."""
        if self.announced:
            return []
        self.announced = True
        u = usage(Usage(self.prompt_tokens, self.cached, 0))
        return [event_frame("message_start", {"type": "message_start",
                                              "message": self.message([], NOT_STOPPED, u)})]

    def start_block(self, block: dict) -> list[bytes]:
        """Close the open block and open a new one."""
        frames = self.stop_block()
        self.index += 1
        self.open = block["type"]
        self.saw.add(block["type"])
        frames.append(event_frame("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block}))
        return frames

    def stop_block(self) -> list[bytes]:
        """Close the open block (a thinking block gets its signature first)."""
        if self.open is None:
            return []
        frames = []
        if self.open == "thinking":
            frames.append(self.delta({"type": "signature_delta", "signature": self.id}))
        frames.append(event_frame("content_block_stop",
                                  {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return frames

    def delta(self, delta: dict) -> bytes:
        """A content_block_delta of the open block."""
        return event_frame("content_block_delta", {"type": "content_block_delta",
                                                   "index": self.index, "delta": delta})

    def text_frames(self, kind: str, text: str) -> list[bytes]:
        """thinking_delta / text_delta frames, opening the block when needed."""
        if not text:
            return []
        frames = []
        if self.open != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                else {"type": "text", "text": ""}
            frames += self.start_block(empty)
        key = "thinking" if kind == "thinking" else "text"
        return frames + [self.delta({"type": f"{key}_delta", key: text})]

    def tokens(self, event: TokenEvents) -> list[bytes]:
        """Frames for one sampled token's parser events."""
        frames = self.message_start()
        for e in event.events:
            frames += self.on(e)
        return frames

    def ignored(self) -> list[bytes]:
        """No frame for the event."""
        return []

    def on_reasoning(self, e: ev.ReasoningDelta) -> list[bytes]:
        """thinking_delta, once the channel lets the text go."""
        return self.text_frames("thinking", self.thinking.push(e.text))

    def on_text(self, e: ev.TextDelta) -> list[bytes]:
        """text_delta, once the channel lets the text go."""
        return self.text_frames("text", self.text.push(e.text))

    def on_call_start(self, e: ev.ToolCallStart) -> list[bytes]:
        """A tool_use block opens."""
        self.streamed_calls.add(e.index)
        return self.start_block({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})

    def on_call_args(self, e: ev.ToolArgsDelta) -> list[bytes]:
        """input_json_delta of the open tool_use block."""
        if not e.text:
            return []
        return [self.delta({"type": "input_json_delta", "partial_json": e.text})]

    def on_call_end(self, e: ev.ToolCallEnd) -> list[bytes]:
        """The tool_use block closes."""
        return self.stop_block()

    def closing(self, finished: Finished) -> list[bytes]:
        """Held-back text, calls not streamed live, message_delta and message_stop."""
        out = finished.output
        frames = self.message_start()  # a job cancelled in the queue never started
        frames += self.text_frames("thinking", self.thinking.finish(out.reasoning))
        frames += self.text_frames("text", self.text.finish(out.content))
        for i, call in enumerate(out.tool_calls):
            if i not in self.streamed_calls:
                frames += self.start_block({"type": "tool_use", "id": call.id, "name": call.name,
                                            "input": {}})
                frames.append(self.delta({"type": "input_json_delta",
                                          "partial_json": call.arguments}))
        if "text" not in self.saw and "tool_use" not in self.saw:
            frames += self.start_block({"type": "text", "text": ""})
        frames += self.stop_block()
        frames.append(event_frame("message_delta", {
            "type": "message_delta", "delta": stop_fields(finished),
            "usage": usage(finished.usage)}))
        return frames + [event_frame("message_stop", {"type": "message_stop"})]

    def failure(self, failed: Failed) -> list[bytes]:
        """An Anthropic `error` event."""
        return [event_frame("error", error_body(failure_error(failed), ANTHROPIC))]

    def ping(self) -> bytes:
        """Anthropic's own keep-alive event."""
        return event_frame("ping", {"type": "ping"})
