"""DSML output grammar shared by both parsers (docs/PROTOCOLS.md, DSML tool calls)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass

from ds4.chat.special_tokens import ASSISTANT, DSML, USER
from ds4.chat.tools_block import to_json

log = logging.getLogger("ds4.chat")

SPACE = " \t\r\n"
SEPARATOR = "\n\n"  # the canonical blank line before a block: syntax, not content
ATTRS = re.compile(r'(?:[ \t\r\n]+[A-Za-z_][\w-]*[ \t\r\n]*=[ \t\r\n]*"[^"]*")*[ \t\r\n]*')
ATTR = re.compile(r'([A-Za-z_][\w-]*)[ \t\r\n]*=[ \t\r\n]*"([^"]*)"')


@dataclass(frozen=True)
class Dialect:
    """Tag spellings of one block: canonical `｜DSML｜`, ds4's tolerated `DSML｜`, or plain."""

    marker: str

    @property
    def start(self) -> str:
        """The block's opening tag."""
        return f"<{self.marker}tool_calls>"

    @property
    def end(self) -> str:
        """The block's closing tag."""
        return f"</{self.marker}tool_calls>"

    @property
    def invoke(self) -> str:
        """An invoke's opening tag up to its attributes."""
        return f"<{self.marker}invoke"

    @property
    def invoke_end(self) -> str:
        """An invoke's closing tag."""
        return f"</{self.marker}invoke>"

    @property
    def param(self) -> str:
        """A parameter's opening tag up to its attributes."""
        return f"<{self.marker}parameter"

    @property
    def param_end(self) -> str:
        """A parameter's closing tag (ends its value)."""
        return f"</{self.marker}parameter>"


DIALECTS = (Dialect(DSML), Dialect("DSML｜"), Dialect(""))
START_MARKERS = tuple(d.start for d in DIALECTS)


def find_start(text: str, pos: int = 0) -> tuple[int, Dialect | None]:
    """Earliest block start marker at or after pos: (index, dialect) or (-1, None)."""
    best, dialect = -1, None
    for d in DIALECTS:
        i = text.find(d.start, pos)
        if i >= 0 and (best < 0 or i < best):
            best, dialect = i, d
    return best, dialect


def is_prefix_of_any(tail: str, candidates: tuple[str, ...]) -> bool:
    """True when tail could still grow into one of the candidates."""
    return any(c.startswith(tail) for c in candidates)


def held_tail(text: str, candidates: tuple[str, ...]) -> int:
    """Where emission must stop so that a partial candidate at the end is not split."""
    start = max(0, len(text) - max(len(c) for c in candidates) + 1)  # partials are shorter
    for i in range(start, len(text)):
        if is_prefix_of_any(text[i:], candidates):
            return i
    return len(text)


def parse_attrs(attrs: str) -> dict[str, str] | None:
    """Attributes of a tag body like ` name="x" string="true"`; None when malformed."""
    if not ATTRS.fullmatch(attrs):
        return None
    return dict(ATTR.findall(attrs))


def invoke_name(attrs: str) -> str | None:
    """The tool name of an invoke tag, None when the tag is malformed or names no tool."""
    parsed = parse_attrs(attrs)
    return (parsed or {}).get("name") or None


def parameter_attrs(attrs: str) -> tuple[str, bool] | None:
    """(key, is_string) of a parameter tag, None when malformed (string defaults to true)."""
    parsed = parse_attrs(attrs)
    if not parsed or "name" not in parsed:
        return None
    flag = parsed.get("string", "true")
    if flag not in ("true", "false"):
        return None
    return parsed["name"], flag == "true"


def key_fragment(key: str, first: bool, is_string: bool) -> str:
    """The arguments bytes a parameter tag opens: `, "key": ` (+ `"` for strings)."""
    return ("" if first else ", ") + to_json(key) + ": " + ('"' if is_string else "")


def string_fragment(value: str) -> str:
    """A piece of a string=true value, escaped as json() escapes it, without quotes."""
    return to_json(value)[1:-1]


def reject_constant(name: str) -> None:
    """NaN and Infinity are Python extensions, not JSON."""
    raise ValueError(name)


def json_value_fragment(value: str) -> str:
    """A string=false value: as is when it is JSON, else its JSON string (and logged)."""
    try:
        json.loads(value, parse_constant=reject_constant)
        return value
    except ValueError:
        log.info("string=false parameter value is not JSON: %r", value[:80])
        return to_json(value)


def id_hash(seed: str) -> hashlib._Hash:
    """Running hash of the output that call ids derive from (fed the text as it is read)."""
    return hashlib.sha256(seed.encode("utf-8") + b"\0")


def call_id(prefix: str, running: hashlib._Hash, index: int) -> str:
    """prefix + 32 hex: a hash of (seed, output up to the invoke tag, call index)."""
    h = running.copy()
    h.update(f"\0{index}".encode("ascii"))
    return prefix + h.hexdigest()[:32]


def utf8(text: str) -> bytes:
    """Bytes of decoded output text (lone surrogates kept, never raised)."""
    return text.encode("utf-8", "surrogatepass")


BAD_INVOKE = "malformed DSML: invalid invoke tag"
BAD_PARAMETER = "malformed DSML: invalid parameter tag"
EXPECTED_INVOKE = "malformed DSML: expected an invoke or the end of the tool calls"
EXPECTED_PARAMETER = "malformed DSML: expected a parameter or the end of the invoke"
TURN_IN_BLOCK = "malformed DSML: a turn marker inside the tool calls"
UNTERMINATED = "unterminated tool call"
# The model opening a new turn inside a block lost the thread (docs/PROTOCOLS.md, Malformed DSML).
TURN_MARKERS = (USER, ASSISTANT)


def has_turn_marker(text: str) -> bool:
    """True when text contains a user/assistant turn marker."""
    return any(m in text for m in TURN_MARKERS)
