"""Reading request fields shared by all protocols: types, model, thinking controls, sampling."""

from __future__ import annotations

import json
import re

from starlette.requests import Request

from ds4.jobs.events import SamplingOptions
from ds4.server.config import MODEL_ALIASES, MODEL_ID, THINK_MAX_MIN_CTX
from ds4.server.errors import ApiError, invalid_json

NUMBER = "number"
INTEGER = "integer"
STRING = "string"
BOOLEAN = "boolean"
ARRAY = "array"
OBJECT = "object"

_CHECKS = {
    NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    INTEGER: lambda v: isinstance(v, int) and not isinstance(v, bool),
    STRING: lambda v: isinstance(v, str),
    BOOLEAN: lambda v: isinstance(v, bool),
    ARRAY: lambda v: isinstance(v, list),
    OBJECT: lambda v: isinstance(v, dict),
}
SEED_WORD = 2**64
# json.loads turns an unpaired escape (a backslash, "ud800") into a lone surrogate, which no
# encoder or tokenizer accepts
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_EFFORTS = {"max": "max", "xhigh": "high", "high": "high", "medium": "high", "low": "high",
            "minimal": "high", "none": "none"}


async def read_json(request: Request, limit: int) -> tuple[dict, str]:
    """The body as a JSON object and as text; 413 past `limit` bytes, 400 if not an object."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise invalid_json() from None
    return parse_json(text), text


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_json(text: str) -> dict:
    """A JSON object, strictly: NaN and Infinity (which Python's json takes) are a 400 too."""
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise invalid_json() from None
    if not isinstance(body, dict):
        raise invalid_json()
    if _SURROGATE_ESCAPE.search(text):
        refuse_lone_surrogates(body)
    return body


def field(body: dict, name: str, *kinds: str, default: object = None) -> object:
    """body[name] if present and of one of `kinds` (null counts as absent); else a 400."""
    value = body.get(name)
    if value is None:
        return default
    if not any(_CHECKS[k](value) for k in kinds):
        raise ApiError(400, f"invalid JSON request: '{name}' must be {' or '.join(kinds)}",
                       param=name)
    return value


def required(body: dict, name: str, *kinds: str) -> object:
    """A field that must be present (`missing <name>` otherwise)."""
    if body.get(name) is None:
        raise ApiError(400, f"missing {name}", param=name)
    return field(body, name, *kinds)


def resolve_model(body: dict) -> tuple[str, str | None]:
    """(model id echoed back, thinking mode its alias implies); unknown ids are a 404."""
    model = field(body, "model", STRING, default=MODEL_ID)
    if model not in MODEL_ALIASES:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                       f"{', '.join(MODEL_ALIASES)}", param="model", code="model_not_found")
    return model, MODEL_ALIASES[model]


def effort_mode(effort: object, name: str) -> str:
    """Thinking mode of a reasoning-effort string."""
    if not isinstance(effort, str) or effort not in _EFFORTS:
        raise ApiError(400, f"invalid JSON request: unsupported {name} {effort!r}", param=name)
    return _EFFORTS[effort]


def _switch(body: dict) -> bool | None:
    """`thinking` (bool or {type}) and `think` (bool): True, False or None when absent."""
    value = field(body, "thinking", BOOLEAN, OBJECT)
    if isinstance(value, dict):
        kind = value.get("type")
        value = None if kind is None else kind != "disabled"
    think = field(body, "think", BOOLEAN)
    return value if value is not None else think


def _effort(body: dict) -> str | None:
    """The explicit effort of any protocol's field, or None."""
    if body.get("reasoning_effort") is not None:
        return effort_mode(body["reasoning_effort"], "reasoning_effort")
    for outer in ("output_config", "reasoning"):
        inner = field(body, outer, OBJECT, default={})
        if inner.get("effort") is not None:
            return effort_mode(inner["effort"], f"{outer}.effort")
    return None


def thinking_mode(body: dict, alias_mode: str | None, ctx: int) -> str:
    """"none" | "high" | "max" from the thinking controls (docs/PROTOCOLS.md, Thinking)."""
    switch, effort = _switch(body), _effort(body)
    if switch is False:
        mode = "none"
    elif effort is not None:
        mode = effort
    elif switch is True:
        mode = "high"
    else:
        mode = alias_mode or "high"
    if mode == "max" and ctx < THINK_MAX_MIN_CTX:
        mode = "high"  # Think Max needs a very long context to be worth it
    return mode


def sampling(body: dict, thinking: str, with_min_p: bool = True,
             with_top_k: bool = True, with_seed: bool = True) -> SamplingOptions:
    """Sampling options; thinking forces the model's own settings and ignores client knobs."""
    # a seed is a 64-bit word (ds4 casts it), so -1 is 2**64-1; 0 means a fresh seed
    seed = (field(body, "seed", INTEGER, default=0) % SEED_WORD if with_seed else 0) or None
    temperature = float(field(body, "temperature", NUMBER, default=1.0))
    top_p = float(field(body, "top_p", NUMBER, default=1.0))
    top_k = field(body, "top_k", INTEGER, default=0) if with_top_k else 0
    min_p = float(field(body, "min_p", NUMBER, default=0.05)) if with_min_p else 0.05
    if thinking != "none":  # fields were still type-checked: a bad request is a 400 either way
        return SamplingOptions(1.0, 0, 1.0, 0.05, seed)
    return SamplingOptions(
        temperature=temperature,
        top_k=min(max(top_k, 0), 1024),
        top_p=top_p if 0.0 < top_p <= 1.0 else 1.0,
        min_p=min(max(min_p, 0.0), 1.0),  # above 1 no token would survive the filter
        seed=seed,
    )


def stop_sequences(body: dict, name: str = "stop") -> list[str]:
    """Stop strings from a string or an array of strings (empty strings dropped)."""
    value = field(body, name, STRING, ARRAY, default=[])
    items = [value] if isinstance(value, str) else value
    if not all(isinstance(s, str) for s in items):
        raise ApiError(400, f"invalid JSON request: '{name}' must hold strings", param=name)
    return [s for s in items if s]


def max_tokens(body: dict, names: tuple[str, ...], default: int) -> int:
    """The first present max-tokens field (negative → 0), else the server default."""
    for name in names:
        value = field(body, name, INTEGER)
        if value is not None:
            return max(value, 0)
    return default


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage)."""
    stream = field(body, "stream", BOOLEAN, default=False)
    options = field(body, "stream_options", OBJECT, default={})
    return stream, bool(options.get("include_usage"))


def lone_surrogate(value: object, where: str = "") -> tuple[str, str] | None:
    """(path, character) of the first string or key holding a lone UTF-16 surrogate."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return (where, found.group()) if found else None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{where}.{key}" if where else str(key)
            if hit := lone_surrogate(key, inner + " (key)") or lone_surrogate(item, inner):
                return hit
    if isinstance(value, list):
        for i, item in enumerate(value):
            if hit := lone_surrogate(item, f"{where}[{i}]"):
                return hit
    return None


def refuse_lone_surrogates(body: dict) -> None:
    """A 400 for a string with an unpaired surrogate escape: it is no Unicode text."""
    try:
        hit = lone_surrogate(body)
    except RecursionError:
        raise invalid_json() from None
    if hit is not None:
        raise lone_surrogate_error(*hit)


def lone_surrogate_error(where: str, char: str) -> ApiError:
    """The 400 naming where the unpaired surrogate sits (`where` may hold one itself)."""
    where = where.encode("utf-8", "backslashreplace").decode() or None
    place = f"'{where}'" if where else "a string of the request"
    return ApiError(400, f"invalid JSON request: {place} holds a lone surrogate escape "
                    f"\\u{ord(char):04x}; strings must be valid Unicode", param=where)
