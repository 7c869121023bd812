"""Events the output parser emits as a turn streams (docs/PROTOCOLS.md, Output parsing)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Generic, TypeVar


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


R = TypeVar("R")  # what a protocol answers to one event: frames, (type, fields) pairs


class ParserEvents(ABC, Generic[R]):
    """One method per parser event, and `on` routing an event to it: the one dispatch every
    protocol's stream shares. A method not overridden answers `ignored()`, which each
    protocol must define (its empty answer)."""

    def on(self, e: ParserEvent) -> R:
        """The answer to one parser event."""
        match e:
            case ReasoningDelta():
                return self.on_reasoning(e)
            case TextDelta():
                return self.on_text(e)
            case ToolCallStart():
                return self.on_call_start(e)
            case ToolArgsDelta():
                return self.on_call_args(e)
            case ToolCallEnd():
                return self.on_call_end(e)
            case Done():
                return self.on_done(e)
        return self.ignored()

    @abstractmethod
    def ignored(self) -> R:
        """The answer to an event this protocol does not show."""

    def on_reasoning(self, e: ReasoningDelta) -> R:
        """More reasoning text."""
        return self.ignored()

    def on_text(self, e: TextDelta) -> R:
        """More answer text."""
        return self.ignored()

    def on_call_start(self, e: ToolCallStart) -> R:
        """A tool call began."""
        return self.ignored()

    def on_call_args(self, e: ToolArgsDelta) -> R:
        """More of a call's arguments."""
        return self.ignored()

    def on_call_end(self, e: ToolCallEnd) -> R:
        """A tool call is complete."""
        return self.ignored()

    def on_done(self, e: Done) -> R:
        """The tool-call block ended."""
        return self.ignored()
