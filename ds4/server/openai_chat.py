"""POST /v1/chat/completions: OpenAI chat (docs/PROTOCOLS.md, Chat completions)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ds4.chat import events as ev
from ds4.chat import render_chat
from ds4.jobs.events import Finished, TokenEvents
from ds4.server import request_fields as rf
from ds4.server.errors import OPENAI
from ds4.server.generation import generate
from ds4.server.openai_object import OpenAIObject, finish_reason, openai_usage
from ds4.server.runtime import Running, Runtime
from ds4.server.sse import Channel, data_frame
from ds4.server.tools import forced_prefix, tool_result_ids
from ds4.server.turn import Turn

ENDPOINT = "/v1/chat/completions"
CHUNK = "chat.completion.chunk"


async def handle(request: Request, runtime: Runtime) -> Response:
    """Serve one chat completion."""
    body, raw = await rf.read_json(request, runtime.config.max_body_bytes)
    runtime.require_serving()
    return await generate(request, runtime, parse(body, raw, runtime), ChatShape)


def parse(body: dict, raw: str, runtime: Runtime) -> Turn:
    """A chat request body as a Turn (400 on missing or wrong-typed fields)."""
    cfg = runtime.config
    model, alias = rf.resolve_model(body)
    messages = rf.required(body, "messages", rf.ARRAY)
    tools = rf.field(body, "tools", rf.ARRAY, default=[])
    choice = rf.field(body, "tool_choice", rf.STRING, rf.OBJECT, default="auto")
    response_format = rf.field(body, "response_format", rf.OBJECT)
    thinking = rf.thinking_mode(body, alias, cfg.ctx)
    stream, include_usage = rf.stream_flags(body)
    active, forced = forced_prefix(tools, choice)
    memory = runtime.tool_memory
    return Turn(
        endpoint=ENDPOINT, protocol=OPENAI, model=model,
        render=lambda: render_chat(messages, tools=tools or None, thinking=thinking,
                                   tool_choice=choice, tool_memory=memory,
                                   response_format=response_format),
        thinking=thinking, sampling=rf.sampling(body, thinking),
        max_tokens=rf.max_tokens(body, ("max_completion_tokens", "max_tokens"), cfg.tokens),
        stop=rf.stop_sequences(body), tools_active=active, forced_text=forced,
        call_ids=tool_result_ids(messages), stream=stream, include_usage=include_usage,
        raw_body=raw)


def message(output) -> dict:
    """The assistant message of a finished turn."""
    msg = {"role": "assistant", "content": output.content}
    if output.reasoning:
        msg["reasoning_content"] = output.reasoning
    if output.tool_calls:
        msg["tool_calls"] = [tool_call(c) for c in output.tool_calls]
    return msg


def tool_call(call: ev.ToolCall, index: int | None = None) -> dict:
    """One OpenAI tool call object (with `index` inside stream deltas)."""
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


class ChatShape(OpenAIObject, ev.ParserEvents[list[bytes]]):
    """chat.completion bodies and chat.completion.chunk frames of one job."""

    def __init__(self, running: Running):
        super().__init__(running, "chatcmpl-")
        self.reasoning = Channel()
        self.content = Channel()
        self.streamed_calls: set[int] = set()

    def body(self, finished: Finished) -> dict:
        """The non-streamed chat.completion."""
        choice = {"index": 0, "message": message(finished.output),
                  "finish_reason": finish_reason(finished)}
        return self.envelope("chat.completion", [choice], usage=openai_usage(finished.usage))

    def chunk(self, delta: dict, finish: str | None = None) -> bytes:
        """One chat.completion.chunk frame."""
        return data_frame(self.envelope(
            CHUNK, [{"index": 0, "delta": delta, "finish_reason": finish}]))

    def opening(self) -> list[bytes]:
        """The role chunk."""
        return [self.chunk({"role": "assistant"})]

    def tokens(self, event: TokenEvents) -> list[bytes]:
        """Deltas for one sampled token's parser events."""
        return [f for e in event.events for f in self.on(e)]

    def ignored(self) -> list[bytes]:
        """Nothing is sent for the event (yet)."""
        return []

    def on_reasoning(self, e: ev.ReasoningDelta) -> list[bytes]:
        """reasoning_content, once the channel lets it go."""
        text = self.reasoning.push(e.text)
        return [self.chunk({"reasoning_content": text})] if text else []

    def on_text(self, e: ev.TextDelta) -> list[bytes]:
        """content, once the channel lets it go."""
        text = self.content.push(e.text)
        return [self.chunk({"content": text})] if text else []

    def on_call_start(self, e: ev.ToolCallStart) -> list[bytes]:
        """The call's id and name, with empty arguments."""
        self.streamed_calls.add(e.index)
        call = ev.ToolCall(e.id, e.name, "")
        return [self.chunk({"tool_calls": [tool_call(call, e.index)]})]

    def on_call_args(self, e: ev.ToolArgsDelta) -> list[bytes]:
        """More of the call's arguments string."""
        if not e.text:
            return []
        return [self.chunk({"tool_calls": [{"index": e.index,
                                             "function": {"arguments": e.text}}]})]

    def closing(self, finished: Finished) -> list[bytes]:
        """Held-back text, calls not streamed live, the finish chunk, usage and [DONE]."""
        out = finished.output
        frames = []
        if text := self.reasoning.finish(out.reasoning):
            frames.append(self.chunk({"reasoning_content": text}))
        if text := self.content.finish(out.content):
            frames.append(self.chunk({"content": text}))
        late = [tool_call(c, i) for i, c in enumerate(out.tool_calls)
                if i not in self.streamed_calls]
        if late:
            frames.append(self.chunk({"tool_calls": late}))
        frames.append(self.chunk({}, finish_reason(finished)))
        return frames + self.ending(CHUNK, finished)
