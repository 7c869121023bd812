"""The renderer's items (docs/PROTOCOLS.md, Prompt rendering): system, user parts, assistant
turns, and how consecutive user parts and tool results merge into one user turn."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ds4.chat.special_tokens import SPECIAL_STRINGS

log = logging.getLogger("ds4.chat")



class ChatError(ValueError):
    """A request the renderer cannot accept; the server answers it with a 400."""


@dataclass
class Call:
    """One tool call of an assistant turn; `arguments` is a JSON string or an object."""

    id: str
    name: str
    arguments: Any


@dataclass
class TextPart:
    """Plain user text."""

    text: str


@dataclass
class ToolResult:
    """A tool's answer, rendered `<tool_result>text</tool_result>`; `call_id` orders it."""

    call_id: str
    text: str


@dataclass
class System:
    """System text; the first one carries the tools block and response format."""

    content: str
    tools: list[dict] | None = None
    response_format: Any = None


@dataclass
class User:
    """One user turn: text parts and tool results joined by blank lines."""

    parts: list[TextPart | ToolResult] = field(default_factory=list)


@dataclass
class Assistant:
    """A past (or, with `open_end`, a to-be-continued) assistant turn."""

    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)
    open_end: bool = False  # rendered without EOS: the model continues it (Anthropic prefill)


Item = System | User | Assistant


def warn_special(text: str, where: str) -> None:
    """Log client text holding a special-token string (docs/PROTOCOLS.md, Special tokens)."""
    for s in SPECIAL_STRINGS:
        if s in text:
            log.warning("%s contains the special token string %r", where, s)
            return


def call_id_text(call_id: Any) -> str:
    """A tool-call id as text ("" when absent); ChatError when the client sent another type."""
    if call_id is None or call_id == "":
        return ""
    if not isinstance(call_id, str):
        raise ChatError(f"tool call ids must be strings, not {type(call_id).__name__}")
    return call_id


def checked_calls(calls: list[Call]) -> list[Call]:
    """The calls of a turn, each with a string id and a non-empty string name."""
    for call in calls:
        if not isinstance(call.name, str) or not call.name:
            raise ChatError("a tool call has no name")
        call.id = call_id_text(call.id)
    return list(calls)


class ItemList:
    """Collects items in request order, merging the way the official encoder does."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self._known_calls: set[str] = set()

    def add_system(self, text: str) -> None:
        """A system/developer message; adjacent ones merge with a blank line."""
        last = self.items[-1] if self.items else None
        if isinstance(last, System):
            last.content += "\n\n" + text
        else:
            self.items.append(System(text))

    def _user(self) -> User:
        last = self.items[-1] if self.items else None
        if isinstance(last, User):
            return last
        user = User()
        self.items.append(user)
        return user

    def add_user_text(self, text: str) -> None:
        """User text; joins the preceding user turn if nothing came between."""
        warn_special(text, "user text")
        self._user().parts.append(TextPart(text))

    def add_tool_result(self, call_id: str | None, text: str) -> None:
        """A tool result; its id must name a call of an earlier assistant turn."""
        call_id = call_id_text(call_id)
        if call_id and call_id not in self._known_calls:
            raise ChatError(f"tool result for unknown tool call id {call_id!r}")
        warn_special(text, "tool result")
        self._user().parts.append(ToolResult(call_id, text))

    def add_assistant(self, reasoning: str, content: str, calls: list[Call]) -> None:
        """An assistant turn (reasoning, visible content, tool calls)."""
        self.items.append(Assistant(reasoning, content, checked_calls(calls)))
        self._known_calls.update(c.id for c in calls if c.id)

    def extend_assistant(self, reasoning: str = "", content: str = "",
                         calls: tuple[Call, ...] | list[Call] = ()) -> None:
        """Append to the assistant turn in progress (Responses items arrive piecewise)."""
        last = self.items[-1] if self.items else None
        if not isinstance(last, Assistant):
            self.add_assistant(reasoning, content, list(calls))
            return
        last.reasoning += reasoning
        last.content += content
        last.calls.extend(checked_calls(list(calls)))
        self._known_calls.update(c.id for c in calls if c.id)

    def finish(self, prefill_last: bool = False) -> list[Item]:
        """Items with tool results sorted into call order; optionally leave the last turn open."""
        sort_tool_results(self.items)
        if prefill_last and self.items and isinstance(self.items[-1], Assistant):
            self.items[-1].open_end = True
        return self.items


def sort_tool_results(items: list[Item]) -> None:
    """Permute each user turn's results into the latest call order; text keeps its slots."""
    order: dict[str, int] = {}
    for item in items:
        if isinstance(item, Assistant) and item.calls:
            order = {c.id: i for i, c in enumerate(item.calls) if c.id}
        elif isinstance(item, User):
            results = [p for p in item.parts if isinstance(p, ToolResult)]
            if len(results) < 2 or not order:
                continue
            ranked = iter(sorted(results, key=lambda p: order.get(p.call_id, 0)))
            item.parts = [next(ranked) if isinstance(p, ToolResult) else p for p in item.parts]
