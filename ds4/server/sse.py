"""Server-sent-event framing, and the bridge from the scheduler thread to one job's event loop."""

from __future__ import annotations

import asyncio
import json

PING_INTERVAL_S = 5.0
COMMENT_PING = b": ping\n\n"
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(obj: object) -> str:
    """Compact JSON with UTF-8 kept as is."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def data_frame(obj: object) -> bytes:
    """`data: <json>` frame (OpenAI chat/completions/Responses)."""
    return ("data: " + dumps(obj) + "\n\n").encode("utf-8")


def event_frame(name: str, obj: object) -> bytes:
    """`event: <name>` + `data: <json>` frame (Anthropic)."""
    return ("event: " + name + "\ndata: " + dumps(obj) + "\n\n").encode("utf-8")


class JobEvents:
    """Per-job asyncio queue fed from the scheduler thread (the job's sink)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def sink(self, event: object) -> None:
        """Called on the scheduler thread: hand the event to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def next(self, timeout: float) -> object | None:
        """The next event, or None when `timeout` seconds pass without one."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None


class Holdback:
    """Text of one stream channel, holding back a tail that may still become a stop sequence."""

    def __init__(self, stop: list[str]):
        self.keep = max((len(s) for s in stop), default=1) - 1
        self.seen = ""
        self.sent = 0

    def push(self, text: str) -> str:
        """Add generated text; return what can be sent now."""
        self.seen += text
        upto = len(self.seen) - self.keep
        if upto <= self.sent:
            return ""
        out = self.seen[self.sent:upto]
        self.sent = upto
        return out

    def finish(self, final: str) -> str:
        """The rest of the channel's final text (after stop-sequence cutting) not yet sent."""
        sent_text = self.seen[: self.sent]
        if not final.startswith(sent_text):
            return ""
        self.sent = len(final)
        self.seen = final
        return final[len(sent_text):]
