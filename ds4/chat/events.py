"""Events the output parser emits as a turn streams (docs/PROTOCOLS.md, Output parsing)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReasoningDelta:
    """More reasoning text (inside <think> ... </think>)."""

    text: str


@dataclass(frozen=True)
class TextDelta:
    """More visible answer text."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A DSML invoke opened: call `index` (0-based in this turn) named `name`, with id `id`."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolArgsDelta:
    """More bytes of call `index`'s JSON arguments string."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Call `index` is complete; `arguments` is its whole JSON arguments string."""

    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    """One parsed call as the APIs return it."""

    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedOutput:
    """Final parse of one generated turn (docs/PROTOCOLS.md, Output parsing)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    raw_block: str = ""  # sampled DSML bytes, for replay (docs/PROTOCOLS.md, Exact replay)
    malformed: str | None = None  # why the DSML was rejected, None when fine or absent
    unterminated: bool = False  # a block opened and never closed


@dataclass(frozen=True)
class Done:
    """The parser saw the end of the tool-call block; decoding should stop."""


ParserEvent = ReasoningDelta | TextDelta | ToolCallStart | ToolArgsDelta | ToolCallEnd | Done
