"""Run one turn to a JSON body or an SSE stream, whatever the protocol's shape."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ds4.jobs.events import Failed, Finished, JobEvent, Started, TokenEvents
from ds4.server.errors import ApiError
from ds4.server.runtime import Running, Runtime
from ds4.server.sse import SSE_HEADERS
from ds4.server.turn import Turn
from ds4.server.wire import json_response

DISCONNECT_POLL_S = 0.5


async def generate(request: Request, runtime: Runtime, turn: Turn,
                   make_shape: Callable[[Running], Shape]) -> Response:
    """Queue the turn and answer with a JSON body or an SSE stream."""
    running = await runtime.start(turn)
    try:
        shape = make_shape(running)
        if turn.stream:
            return await open_stream(runtime, running, shape)
    except BaseException:
        running.cancel()  # the job must not outlive a handler that failed to answer
        raise
    finished = await collect(request, running)
    if finished is None:
        return Response(status_code=499)  # nobody is listening any more
    return json_response(shape.body(finished))


class Shape(Protocol):
    """How one protocol turns job events into a body or SSE frames."""

    def body(self, finished: Finished) -> dict: ...
    def opening(self) -> list[bytes]: ...
    def started(self, event: Started) -> list[bytes]: ...
    def tokens(self, event: TokenEvents) -> list[bytes]: ...
    def closing(self, finished: Finished) -> list[bytes]: ...
    def failure(self, failed: Failed) -> list[bytes]: ...
    def ping(self) -> bytes: ...


def failure_error(failed: Failed) -> ApiError:
    """A failed job as an ApiError (a failed generation is never a 200)."""
    code = "context_length_exceeded" if failed.kind == "context_overflow" else None
    return ApiError(failed.status, failed.message, code=code)


async def collect(request: Request, running: Running) -> Finished | None:
    """Wait for the end of a non-streamed job; a client that goes away cancels it."""
    watcher = asyncio.create_task(cancel_on_disconnect(request, running))
    try:
        while not running.cancelled:
            event = await running.next(DISCONNECT_POLL_S)
            if isinstance(event, Finished):
                return event
            if isinstance(event, Failed):
                raise failure_error(event)
        return None
    finally:
        watcher.cancel()
        running.cancel()


async def cancel_on_disconnect(request: Request, running: Running) -> None:
    """After the body is read, the next ASGI message is http.disconnect: cancel the job then."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    running.cancel()


async def open_stream(runtime: Runtime, running: Running, shape: Shape) -> Response:
    """Hold headers until the first token, a failure, or one ping interval (then stream)."""
    early: list[JobEvent] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + runtime.config.ping_interval_s
    while (left := deadline - loop.time()) > 0:
        event = await running.next(left)
        if isinstance(event, Failed):
            raise failure_error(event)
        if event is None:
            break
        early.append(event)
        if isinstance(event, (TokenEvents, Finished)):
            break
    frames = stream_frames(runtime, running, shape, early)
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)


async def stream_frames(runtime: Runtime, running: Running, shape: Shape,
                        early: list[JobEvent]) -> AsyncIterator[bytes]:
    """SSE frames of a job; a ping after each interval with no frame sent (queued, prefilling
    or descheduled, whatever events the job sends meanwhile); disconnect cancels the job."""
    loop = asyncio.get_running_loop()
    interval = runtime.config.ping_interval_s
    try:
        for frame in shape.opening():
            yield frame
        last_sent, pending = loop.time(), early
        while True:
            for event in pending:
                frames, done = frames_of(shape, event)
                for frame in frames:
                    yield frame
                last_sent = loop.time() if frames else last_sent
                if done:
                    return
            event = await running.next(max(0.0, last_sent + interval - loop.time()))
            pending = [] if event is None else [event]
            if event is None:
                yield shape.ping()
                last_sent = loop.time()
    finally:
        running.cancel()


def frames_of(shape: Shape, event: JobEvent) -> tuple[list[bytes], bool]:
    """Frames for one job event and whether the stream ends with it."""
    if isinstance(event, TokenEvents):
        return shape.tokens(event), False
    if isinstance(event, Started):
        return shape.started(event), False
    if isinstance(event, Finished):
        return shape.closing(event), True
    if isinstance(event, Failed):
        return shape.failure(event), True
    return [], False
