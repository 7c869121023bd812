"""Each HTTP exchange from request to last byte: a quiet end for a client that hung up, the
per-route counters and latency, one access-log line; and a whole 500 for a bug."""

from __future__ import annotations

import logging
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ds4.server.errors import ApiError, error_response, protocol_of_path
from ds4.server.metrics import Metrics

ACCESS = logging.getLogger("ds4.access")
log = logging.getLogger("ds4.server")
# the label of every path outside this set is "other": scanners must not grow /metrics
ROUTES = frozenset({"/", "/health", "/metrics", "/slots", "/v1/models", "/v1/chat/completions",
                    "/v1/completions", "/v1/responses", "/v1/messages",
                    "/v1/messages/count_tokens"})
MODEL_ROUTE = "/v1/models/{model_id}"
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request": nothing was sent
# set in the scope by the connection's protocol when it gave up on a slow client
TIMED_OUT_KEY = "ds4.client_timed_out"


@dataclass
class TokenCounts:
    """Prompt and completion tokens of one request, as far as they are known."""

    prompt: int | None = None
    completion: int | None = None


_tokens: ContextVar[TokenCounts | None] = ContextVar("ds4_request_tokens", default=None)


def note_tokens(prompt: int | None = None, completion: int | None = None) -> None:
    """Record token counts for the current request's access-log line (no-op outside one)."""
    counts = _tokens.get()
    if counts is None:
        return
    counts.prompt = counts.prompt if prompt is None else prompt
    counts.completion = counts.completion if completion is None else completion


def route_label(path: str) -> str:
    """The route a path is counted under; unknown paths share one label."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return MODEL_ROUTE
    return "other"


def log_access_to_stderr() -> None:
    """Write the access log (one line per request) to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ds4-server: %(message)s"))
    ACCESS.addHandler(handler)
    ACCESS.setLevel(logging.INFO)
    ACCESS.propagate = False


class StatusWatch:
    """A `send` that remembers the response's status once it started."""

    def __init__(self, send: Send):
        self.inner = send
        self.status: int | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.inner(message)


class Exchange:
    """What one request's access line and metrics need: status, timing, tokens, a note."""

    def __init__(self, scope: Scope):
        self.scope = scope
        self.started = time.monotonic()
        self.send: StatusWatch | None = None
        self.tokens = TokenCounts()
        self.note = ""

    def final_status(self) -> int:
        """The status the client got (408 when the connection timed it out, 499 for none)."""
        if self.scope.get(TIMED_OUT_KEY):
            self.note = "the client sent its body too slowly"
            return 408
        return (self.send and self.send.status) or CLIENT_CLOSED

    def line(self, status: int, seconds: float) -> str:
        """The access-log line."""
        client = self.scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        parts = [who, self.scope["method"], self.scope["path"], str(status), f"{seconds:.3f}s"]
        if self.tokens.prompt is not None:
            parts.append(f"prompt_tokens={self.tokens.prompt}")
        if self.tokens.completion is not None:
            parts.append(f"completion_tokens={self.tokens.completion}")
        return " ".join(parts) + (f" ({self.note})" if self.note else "")


class ExchangeLayer:
    """ASGI layer around the whole app, one `Exchange` per HTTP request."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        exchange = Exchange(scope)
        reset = _tokens.set(exchange.tokens)
        try:
            await self.run(exchange, receive, send)
        finally:
            _tokens.reset(reset)
            self.finish(exchange)

    async def run(self, exchange: Exchange, receive: Receive, send: Send) -> None:
        """The app; a client gone before its request was read is a note, not an error."""
        exchange.send = StatusWatch(send)
        try:
            await self.app(exchange.scope, receive, exchange.send)
        except ClientDisconnect:
            exchange.note = "the client closed the connection before its request was read"

    def finish(self, exchange: Exchange) -> None:
        """Count the request and write its access-log line."""
        seconds = time.monotonic() - exchange.started
        status = exchange.final_status()
        route = route_label(exchange.scope["path"])
        self.metrics.http_requests.labels(route, f"{status // 100}xx").inc()
        self.metrics.http_seconds.labels(route).observe(seconds)
        ACCESS.info(exchange.line(status, seconds))


class InternalErrorLayer:
    """ASGI layer that answers a bug (an unhandled exception) with a whole 500."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        watch = StatusWatch(send)
        try:
            await self.app(scope, receive, watch)
        except ClientDisconnect:
            raise
        except Exception as exc:
            if watch.status is not None:
                raise  # headers went out: the server must cut the connection
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            await internal_error(exc, scope, receive, send)


async def internal_error(exc: Exception, scope: Scope, receive: Receive, send: Send) -> None:
    """A 500 in the path's protocol. The connection closes cleanly after it (the request may
    not have been read to its end); Starlette's own 500 would drop it unannounced instead."""
    err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
    response = error_response(err, protocol_of_path(scope["path"]), {"Connection": "close"})
    await response(scope, receive, send)
