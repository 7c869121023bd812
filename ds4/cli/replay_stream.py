"""`ds4-replay --url` reads each reply as a stream: the time of every chunk that carries
generated output (vLLM's token arrivals, from which TTFT, ITL and TPOT follow) and, folded
together, the same body the non-streamed request would have returned, so the comparison with
the trace reads one shape whichever way the reply came."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
RESPONSES_OUTPUT = (".delta",)  # response.output_text.delta, ...arguments.delta, ...
RESPONSES_END = ("response.completed", "response.incomplete")


def streamed_request(endpoint: str, request: dict) -> dict:
    """The recorded request, streamed; OpenAI routes also asked for the usage chunk."""
    out = {**request, "stream": True}
    if endpoint in (COMPLETIONS, CHAT):
        out["stream_options"] = {**(request.get("stream_options") or {}), "include_usage": True}
    return out


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """(event name, data) of each SSE frame; comments and keep-alives skipped."""
    name, data = None, []
    for line in lines:
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield name, "\n".join(data)


@dataclass
class Folded:
    """A stream read whole: the equivalent body, or the in-stream error that ended it."""

    body: dict = field(default_factory=dict)
    error: str | None = None


class ChatFold:
    """chat.completion.chunk deltas folded into one chat.completion message."""

    def __init__(self) -> None:
        self.content, self.reasoning, self.usage = "", "", None
        self.calls: dict[int, dict] = {}

    def add(self, event: dict) -> bool:
        """Fold one chunk; True when it carried generated output."""
        self.usage = event.get("usage") or self.usage
        choice = (event.get("choices") or [{}])[0]
        delta = choice.get("delta") or {}
        self.content += delta.get("content") or ""
        self.reasoning += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls") or []:
            self.add_call(call)
        return bool(delta.get("content") or delta.get("reasoning_content")
                    or delta.get("tool_calls"))

    def add_call(self, call: dict) -> None:
        """A tool call's first delta names it; later ones append to its arguments."""
        fn = call.get("function") or {}
        held = self.calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
        held["name"] = fn.get("name") or held["name"]
        held["arguments"] += fn.get("arguments") or ""

    def body(self) -> dict:
        """The equivalent chat.completion."""
        calls = [{"type": "function", "function": c} for _, c in sorted(self.calls.items())]
        message = {"content": self.content, "reasoning_content": self.reasoning,
                   "tool_calls": calls}
        return {"choices": [{"message": message}], "usage": self.usage}


class CompletionFold:
    """text_completion chunks folded into one text."""

    def __init__(self) -> None:
        self.text, self.usage = "", None

    def add(self, event: dict) -> bool:
        """Fold one chunk; True when it carried text."""
        self.usage = event.get("usage") or self.usage
        text = ((event.get("choices") or [{}])[0]).get("text") or ""
        self.text += text
        return bool(text)

    def body(self) -> dict:
        """The equivalent text_completion."""
        return {"choices": [{"text": self.text}], "usage": self.usage}


class MessageFold:
    """Anthropic content-block events folded into one message's blocks."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict] = {}
        self.partial: dict[int, str] = {}
        self.usage: dict = {}

    def add(self, event: dict) -> bool:
        """Fold one event; True for a delta of generated output (not a signature)."""
        kind, index = event.get("type"), event.get("index", 0)
        if kind == "content_block_start":
            self.blocks[index] = dict(event["content_block"])
        elif kind == "content_block_delta":
            return self.add_delta(index, event["delta"])
        elif kind == "message_delta":
            self.usage.update(event.get("usage") or {})
        return False

    def add_delta(self, index: int, delta: dict) -> bool:
        """Append a text, thinking or tool input delta to its block."""
        block, kind = self.blocks.setdefault(index, {"type": "text", "text": ""}), delta["type"]
        if kind == "input_json_delta":
            self.partial[index] = self.partial.get(index, "") + delta["partial_json"]
        elif kind in ("text_delta", "thinking_delta"):
            key = kind.removesuffix("_delta")
            block[key] = block.get(key, "") + delta[key]
        return kind != "signature_delta"

    def body(self) -> dict:
        """The equivalent message; a tool_use block's input is its whole JSON."""
        for index, text in self.partial.items():
            self.blocks[index]["input"] = json.loads(text or "{}")
        return {"content": [b for _, b in sorted(self.blocks.items())], "usage": self.usage}


class ResponseFold:
    """A Responses stream: its terminal event carries the whole response."""

    def __init__(self) -> None:
        self.response: dict = {}

    def add(self, event: dict) -> bool:
        """Keep the final response; True for a delta of generated output."""
        kind = event.get("type") or ""
        if kind in RESPONSES_END:
            self.response = event["response"]
        return kind.endswith(RESPONSES_OUTPUT)

    def body(self) -> dict:
        """The response the terminal event carried."""
        return self.response


FOLDS = {CHAT: ChatFold, COMPLETIONS: CompletionFold, MESSAGES: MessageFold,
         RESPONSES: ResponseFold}


def stream_error(name: str | None, event: dict) -> str | None:
    """The message of an in-stream error event (OpenAI, Anthropic or Responses), else None."""
    if name == "error" or event.get("type") == "error" or \
            (event.get("error") and "choices" not in event):
        return json.dumps(event.get("error") or event)
    if event.get("type") == "response.failed":
        return json.dumps((event.get("response") or {}).get("error") or event)
    return None


def fold_stream(endpoint: str, lines: Iterator[str], now: Callable[[], float]
                ) -> tuple[Folded, list[float]]:
    """Read a reply's stream: the folded body (or its error) and each output chunk's time."""
    fold, times = FOLDS[endpoint](), []
    for name, data in sse_events(lines):
        if data == "[DONE]":
            continue
        event = json.loads(data)
        if (error := stream_error(name, event)) is not None:
            return Folded(error=error), times
        if fold.add(event):
            times.append(now())
    body = fold.body()
    return (Folded(body) if body else Folded(error="the stream ended before its last event")), \
        times
