"""HTTP/1.1 connections that do not wait forever on a slow client.

uvicorn bounds how long an idle keep-alive connection lives, but not how long a request's
headers or body may take: a client trickling one byte every few seconds holds its connection
(and, once its headers are in, its handler) for as long as it likes. Here each connection
watches the part of a request it is waiting for. The headers must be whole within the client
timeout of their first byte; a body may take the timeout plus one second per `MIN_BODY_RATE`
bytes received, and never stall longer than the timeout. Past that the client gets a 408 (when
no response began) and the connection is closed.
"""

from __future__ import annotations

import json
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ds4.server.errors import OPENAI, ApiError, error_body, protocol_of_path
from ds4.server.exchange import ACCESS, TIMED_OUT_KEY
from ds4.server.metrics import Metrics

MIN_BODY_RATE = 16 * 1024  # bytes/s: slower than any real link, faster than a trickle
HEADERS, BODY = "headers", "body"


def timeout_response(message: str, path: str | None) -> bytes:
    """A whole 408 in the path's protocol (OpenAI's before a path is known), closing."""
    protocol = protocol_of_path(path) if path else OPENAI
    body = (json.dumps(error_body(ApiError(408, message), protocol)) + "\n").encode()
    head = ("HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


class ClientTimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline on the request part it waits for."""

    client_timeout_s = 10.0
    metrics: Metrics | None = None  # counts requests that never reached the app

    def connection_made(self, transport) -> None:  # type: ignore[override]
        """Start the clock: a fresh connection waits for its first request's headers."""
        super().connection_made(transport)
        self.phase: tuple[str, int] | None = None
        self.phase_start = self.last_bytes = time.monotonic()
        self.phase_bytes = 0
        self.ticker = self.loop.call_later(self.tick_s(), self.check)

    def data_received(self, data: bytes) -> None:
        """Bytes from the client are progress in the current phase."""
        self.last_bytes = time.monotonic()
        self.phase_bytes += len(data)
        super().data_received(data)
        self.update_phase()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the clock."""
        self.ticker.cancel()
        super().connection_lost(exc)

    def tick_s(self) -> float:
        """How often a connection checks its deadline."""
        return min(1.0, self.client_timeout_s / 4)

    def waiting_for(self) -> str | None:
        """HEADERS or BODY while the next step is the client's; None otherwise."""
        their = self.conn.their_state
        if their is h11.IDLE:
            # an idle keep-alive connection is uvicorn's to close; a fresh one is ours
            partial = bool(self.conn.trailing_data[0])
            return HEADERS if partial or self.cycle is None else None
        if their is h11.SEND_BODY and not self.flow.read_paused:
            return BODY  # paused reading means the app, not the client, is behind
        return None

    def update_phase(self) -> None:
        """A new phase (or the same one of another request) restarts the clock."""
        waiting = self.waiting_for()
        phase = None if waiting is None else (waiting, id(self.cycle))
        if phase != self.phase:
            self.phase, self.phase_bytes = phase, 0
            self.phase_start = self.last_bytes = time.monotonic()

    def deadline(self) -> float:
        """When the current phase's time is up."""
        allowed = self.phase_start + self.client_timeout_s + self.phase_bytes / MIN_BODY_RATE
        return min(allowed, self.last_bytes + self.client_timeout_s)

    def check(self) -> None:
        """Periodic: give up on the client once its phase's deadline has passed."""
        if self.transport.is_closing():
            return
        self.update_phase()
        if self.phase is not None and time.monotonic() > self.deadline():
            self.give_up(self.phase[0])
            return
        self.ticker = self.loop.call_later(self.tick_s(), self.check)

    def give_up(self, waiting: str) -> None:
        """Answer 408 where no response began, then close the connection."""
        cycle = self.cycle if waiting == BODY else None
        partial = waiting == BODY or bool(self.conn.trailing_data[0])
        if partial and (cycle is None or not cycle.response_started):
            what = "body" if cycle else "headers"
            message = (f"request timeout: the request {what} did not arrive within "
                       f"{self.client_timeout_s:g} s")
            self.transport.write(timeout_response(message, cycle and cycle.scope["path"]))
            if cycle is not None:
                cycle.scope[TIMED_OUT_KEY] = True  # the app's exchange logs it as a 408
            else:
                self.log_headers_timeout()
        self.transport.close()

    def log_headers_timeout(self) -> None:
        """Count and log a request that never reached the app."""
        if self.metrics is not None:
            self.metrics.http_requests.labels("other", "4xx").inc()
        who = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        ACCESS.info(f"{who} - - 408 {time.monotonic() - self.phase_start:.3f}s "
                    "(request headers incomplete)")


def client_protocol(timeout_s: float, metrics: Metrics | None = None) -> type[H11Protocol]:
    """The uvicorn `http` protocol class that gives clients `timeout_s` to send a request."""
    return type("ClientTimedH11Protocol", (ClientTimedH11Protocol,),
                {"client_timeout_s": timeout_s, "metrics": metrics})
