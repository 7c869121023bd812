"""JSON bodies as this server writes them (UTF-8 kept, a trailing newline like ds4)."""

from __future__ import annotations

import json
import secrets
import time

from starlette.responses import Response


def json_response(obj: object, status: int = 200, headers: dict | None = None) -> Response:
    """A JSON response whose body ends with a newline."""
    body = json.dumps(obj, ensure_ascii=False) + "\n"
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def new_id(prefix: str, hex_chars: int = 24) -> str:
    """A random id: prefix + lowercase hex."""
    return prefix + secrets.token_hex(hex_chars // 2)


def now() -> int:
    """Unix seconds, for `created` fields."""
    return int(time.time())
