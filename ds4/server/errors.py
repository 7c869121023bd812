"""Errors in each protocol's own wire shape (OpenAI or Anthropic) with the right HTTP status."""

from __future__ import annotations

from starlette.responses import Response

from ds4.server.wire import json_response

OPENAI = "openai"
ANTHROPIC = "anthropic"

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """A request the server refuses or a generation that failed; rendered per protocol."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.extra = extra or {}


def invalid_json() -> ApiError:
    """The body is not JSON, not an object, or a known field has the wrong type."""
    return ApiError(400, "invalid JSON request")


def openai_error_type(status: int) -> str:
    """OpenAI's error `type` for a status."""
    if status >= 500:
        return "server_error"
    if status == 401:
        return "authentication_error"
    return "invalid_request_error"


def anthropic_error_type(status: int) -> str:
    """Anthropic's error `type` for a status."""
    if status >= 500 and status not in _ANTHROPIC_TYPES:
        return "api_error"
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error")


def anthropic_message(err: ApiError) -> str:
    """The message in Anthropic's words where a client acts on them: a prompt over the context
    opens with "prompt is too long: N tokens > M maximum", which Claude Code reads to compact
    its conversation and retry (ds4's own sentence follows in parentheses)."""
    if err.code == "context_length_exceeded" and "n_ctx" in err.extra:
        return (f"prompt is too long: {err.extra['n_prompt_tokens']} tokens > "
                f"{err.extra['n_ctx']} maximum ({err.message})")
    return err.message


def error_body(err: ApiError, protocol: str) -> dict:
    """The JSON error object of a protocol."""
    if protocol == ANTHROPIC:
        inner = {"type": anthropic_error_type(err.status), "message": anthropic_message(err),
                 **err.extra}
        return {"type": "error", "error": inner}
    inner = {"message": err.message, "type": openai_error_type(err.status),
             "param": err.param, "code": err.code, **err.extra}
    return {"error": inner}


def error_response(err: ApiError, protocol: str, headers: dict | None = None) -> Response:
    """A JSON error response (body ends with a newline, as every JSON body here)."""
    return json_response(error_body(err, protocol), err.status, headers)


def protocol_of_path(path: str) -> str:
    """Anthropic paths answer errors in Anthropic's shape; everything else in OpenAI's."""
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI
