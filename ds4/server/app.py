"""The Starlette app: routes, API key and CORS gate, protocol-shaped errors, health and metrics."""

from __future__ import annotations

import contextlib
import hmac
import time

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ds4.server import anthropic, completions, models, openai_chat, responses
from ds4.server.config import MODEL_ALIASES, ServerConfig
from ds4.server.errors import ApiError, error_response, protocol_of_path
from ds4.server.exchange import ExchangeLayer, InternalErrorLayer
from ds4.server.runtime import BROKEN, SERVING, Runtime
from ds4.server.wire import json_response

CORS_HEADERS = [(b"access-control-allow-origin", b"*"),
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", b"*")]


def build_app(config: ServerConfig, runtime: Runtime | None = None, load: bool = True) -> Starlette:
    """The ASGI app; with `load` the model loads in the background at start-up."""
    runtime = runtime or Runtime(config)

    def bind(handler):
        async def endpoint(request: Request) -> Response:
            return await handler(request, runtime)
        return endpoint

    routes = [
        Route("/", bind(root)), Route("/health", bind(health)), Route("/metrics", bind(metrics)),
        Route("/slots", bind(slots)),
        Route("/v1/models", bind(models.list_models)),
        Route("/v1/models/{model_id:path}", bind(models.get_model)),
        Route("/v1/chat/completions", bind(openai_chat.handle), methods=["POST"]),
        Route("/v1/completions", bind(completions.handle), methods=["POST"]),
        Route("/v1/responses", bind(responses.handle), methods=["POST"]),
        Route("/v1/messages", bind(anthropic.handle), methods=["POST"]),
        Route("/v1/messages/count_tokens", bind(anthropic.count_tokens), methods=["POST"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if load:
            runtime.load_in_background()
        yield
        runtime.stop()

    # a bug's 500 is InternalErrorLayer's: Starlette's own would drop a keep-alive connection
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        ApiError: api_error, HTTPException: http_error})
    app.state.runtime = runtime
    app.add_middleware(InternalErrorLayer)  # the last added runs first: Exchange, Gate, this
    app.add_middleware(Gate, config=config)
    app.add_middleware(ExchangeLayer, metrics=runtime.metrics)
    return app


class Gate:
    """ASGI layer before routing: OPTIONS → 204, CORS headers, API key on /v1 paths."""

    def __init__(self, app: ASGIApp, config: ServerConfig):
        self.app = app
        self.cors = config.cors
        self.api_key = config.api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = self.with_cors(send) if self.cors else send
        if scope["method"] == "OPTIONS":
            return await Response(status_code=204)(scope, receive, send)
        if self.api_key and scope["path"].startswith("/v1/") and not self.authorized(scope):
            err = ApiError(401, "invalid or missing API key", code="invalid_api_key")
            return await error_response(err, protocol_of_path(scope["path"]))(scope, receive, send)
        await self.app(scope, receive, send)

    def authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic)."""
        headers = dict(scope["headers"])
        bearer = headers.get(b"authorization", b"").decode("latin-1")
        given = bearer[7:] if bearer.lower().startswith("bearer ") else ""
        given = given or headers.get(b"x-api-key", b"").decode("latin-1")
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    @staticmethod
    def with_cors(send: Send) -> Send:
        """`send` that adds the CORS headers to the response start."""
        async def cors_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + CORS_HEADERS}
            await send(message)
        return cors_send


async def api_error(request: Request, exc: ApiError) -> Response:
    """An ApiError in the shape of the path's protocol."""
    return error_response(exc, protocol_of_path(request.url.path))


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Unknown paths and wrong methods."""
    status = 404 if exc.status_code in (404, 405) else exc.status_code
    message = "unknown endpoint" if status == 404 else str(exc.detail)
    return error_response(ApiError(status, message), protocol_of_path(request.url.path))


async def root(request: Request, runtime: Runtime) -> Response:
    """200 with the server's name and routes: clients probe the base URL before they use it
    (Claude Code sends `HEAD /` first), and a person opening it in a browser learns where to go."""
    return json_response({"name": "ds4-server", "models": list(MODEL_ALIASES),
                          "routes": [r.path for r in request.app.routes if r.path != "/"]})


async def health(request: Request, runtime: Runtime) -> Response:
    """200 when the model is loaded and the scheduler runs (with the model's fingerprint and
    the --trace file), else 503 (loading, a failed load, or an engine that can no longer step)."""
    fault = runtime.engine_fault() if runtime.state == SERVING else None
    if fault is not None:  # e.g. an expert worker (--gpus) has exited: every step would fail
        return json_response({"status": "error", "error": fault}, 503)
    if runtime.state == SERVING:
        trace = runtime.trace_file()  # lets ds4-replay refuse to replay a trace into its writer
        model = {"model_fingerprint": runtime.model_fingerprint}  # and another model's trace
        return json_response({"status": "ok", **model, **({"trace": trace} if trace else {})})
    body = {"status": "error", "error": runtime.error} if runtime.state == BROKEN \
        else {"status": "loading"}
    return json_response(body, 503)


async def metrics(request: Request, runtime: Runtime) -> Response:
    """Prometheus text exposition."""
    return Response(runtime.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def slots(request: Request, runtime: Runtime) -> Response:
    """Per slot: busy, tokens held, last used (Unix seconds; null before its first job) and
    decode_batch, the slots that shared its last decode step."""
    runtime.require_serving()
    to_wall = time.time() - time.monotonic()  # the scheduler runs on the monotonic clock
    info = [{**s, "last_used": round(s["last_used"] + to_wall, 3) if s["last_used"] else None}
            for s in runtime.scheduler.slots_info()]
    return json_response({"slots": info})
