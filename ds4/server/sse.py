"""Server-sent-event framing, and the bridge from the scheduler thread to one job's event loop."""

from __future__ import annotations

import asyncio
import json

from ds4.jobs.events import JobEvent

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
        self.queue: asyncio.Queue[JobEvent] = asyncio.Queue()

    def sink(self, event: JobEvent) -> None:
        """Called on the scheduler thread: hand the event to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def next(self, timeout: float) -> JobEvent | None:
        """The next event, or None when `timeout` seconds pass without one."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None


class Channel:
    """Text of one stream channel: what was sent, and what the final text still adds."""

    def __init__(self) -> None:
        self.sent = ""

    def push(self, text: str) -> str:
        """Record text as sent; return it."""
        self.sent += text
        return text

    def finish(self, final: str) -> str:
        """The part of the channel's final text not sent yet ("" if the stream went elsewhere)."""
        if not final.startswith(self.sent):
            return ""
        rest, self.sent = final[len(self.sent):], final
        return rest
